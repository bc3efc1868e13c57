//! `serve`: the policy behind an OpenAI-compatible HTTP API (`trainer::serve`).

use std::io::Write;

use anyhow::{Context, Result};
use burn::tensor::backend::AutodiffBackend;

use trainer::serve::engine::Engine;
use trainer::serve::model::{load, ModelSource};
use trainer::serve::request::Limits;
use trainer::serve::{router, ServeSettings};

use crate::cli::ServeArgs;
use crate::device::{DeviceEnv, Job};

/// The server, as a [`Job`].
pub struct Serve<'a>(pub &'a ServeArgs);

impl Job for Serve<'_> {
    fn run<B: AutodiffBackend>(self, device: B::Device, _env: &DeviceEnv) -> Result<()> {
        // Inference only: the backend without autodiff.
        serve::<B::InnerBackend>(self.0, device)
    }
}

fn serve<B: burn::tensor::backend::Backend>(a: &ServeArgs, device: B::Device) -> Result<()> {
    let src = ModelSource {
        tiny_random: a.tiny_random,
        seed: a.seed,
        model: a.model.clone(),
        checkpoint: a.checkpoint.clone(),
        adapter: a.adapter.clone(),
        template: a.template,
    };
    let loaded = load::<B>(&src, a.context, &device).context("loading the model")?;
    let settings = ServeSettings {
        model_name: a.served_model_name.clone().unwrap_or(loaded.name),
        limits: Limits {
            context: loaded.context,
            default_max_tokens: a.default_max_tokens,
            max_n: a.max_n,
        },
        max_body_bytes: a.max_body_bytes,
    };
    tracing::info!(model = %settings.model_name, context = loaded.context, "model loaded");
    let renderer = loaded.model.renderer.clone();
    let engine = Engine::start(loaded.model, a.max_batch, a.max_queue)
        .context("starting the generation thread")?;
    let app = router(settings, renderer, engine);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        // The first line of stdout: a caller that asked for port 0 reads the port here.
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{addr}")?;
        out.flush()?;
        drop(out);
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown())
            .await
            .context("serving")
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
