//! Evaluations started ahead of their device lease (`prestart`, the CUDA default) on the real
//! sandbox and torch, CPU device: judged as without it, one lease at a time, and a verdict the
//! judge reaches before its gate (a forbidden source) ends the evaluation cleanly without the
//! device; the device is taken only once a judge waits at its gate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::http::StatusCode;
use common::{call, state_from, test_config};
use env_server::ServerConfig;
use serde_json::json;
use std::sync::atomic::Ordering;

const ADD_CANDIDATE: &str = include_str!("../../tests/cpu_add_candidate.py");

#[tokio::test]
async fn prestarted_evaluations_are_judged_one_lease_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    // torch.compile on: the compile baseline's cache directory is shared by the device's
    // judges, and belongs to whichever holds the lease (handed over at start, it went to the
    // last judge started and the one timing could not write it: a harness error).
    let s = state_from(ServerConfig {
        prestart: Some(true),
        skip_compile: false,
        ..test_config(dir.path())
    });
    // Two distinct sources (two builds), submitted together: one times while the other
    // waits at its gate with its processes up.
    let a = json!({"task": "L1/2_Add", "solution": ADD_CANDIDATE});
    let b = json!({"task": "L1/2_Add", "solution": format!("{ADD_CANDIDATE}\n# the second\n")});
    let forbidden =
        json!({"task": "L1/2_Add", "solution": format!("{ADD_CANDIDATE}\nimport torch._dynamo\n")});
    let (ra, rb, rf) = tokio::join!(
        call(&s, "POST", "/v1/evaluate", Some(a)),
        call(&s, "POST", "/v1/evaluate", Some(b)),
        call(&s, "POST", "/v1/evaluate", Some(forbidden)),
    );
    for (st, r) in [&ra, &rb] {
        assert_eq!(*st, StatusCode::OK, "{r}");
        assert_eq!(r["correct"], true, "{r}");
        // The judge ran with the gate: its clock has the prestart and the wait apart.
        let stages = &r["details"]["check"]["stage_s"];
        for k in ["prestart", "lease_wait", "start", "check", "time"] {
            assert!(stages[k].is_number(), "{k} missing in {stages}");
        }
        assert!(r["times_ms"]["compile"].is_number(), "{r}");
        // The lease is taken when the judge waits at its gate, not when it is started: the
        // judge's own start (its clock's `prestart`, from after its imports to the gate) lies
        // inside the server's wait for the lease. Taken at the judge's spawn, the device was
        // held through every import (on an H100, 12 s of a 25 s lease with compile skipped).
        let waited = r["details"]["phases"]["lease_wait_s"].as_f64().unwrap();
        let started = stages["prestart"].as_f64().unwrap();
        assert!(
            waited >= started,
            "the lease came before the judge was at its gate: waited {waited} s, its start took {started} s: {r}"
        );
        // What the lease was held for is said, and covers the judge's work after its gate.
        let phases = &r["details"]["phases"];
        let held = phases["lease_held_s"].as_f64().unwrap();
        let after_gate: f64 = ["start", "check", "second_shape", "time", "finish"]
            .iter()
            .filter_map(|k| stages[*k].as_f64())
            .sum();
        assert!(
            held >= after_gate,
            "held {held} s < the judge's {after_gate} s after its gate: {r}"
        );
        let parts =
            phases["lease_to_go_s"].as_f64().unwrap() + phases["teardown_s"].as_f64().unwrap();
        assert!(parts <= held, "{r}");
    }
    let (st, r) = rf;
    assert_eq!(st, StatusCode::OK, "{r}");
    assert_eq!(r["correct"], false, "{r}");
    assert_eq!(r["reward"], -1.0, "{r}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .starts_with("forbidden_source"),
        "{r}"
    );
    let unleased = r["details"]["phases"]["lease_held_s"]
        .as_f64()
        .unwrap_or(0.0);
    assert_eq!(
        unleased, 0.0,
        "a judge that never took the device held it: {r}"
    );
    // One device, one lease each for the two judged; none for the forbidden one, whose judge
    // answered before its gate and never needed the device.
    assert_eq!(s.evaluator.slots()[0].leases.load(Ordering::Relaxed), 2);
    // The depth the server starts ahead is said where clients look, and how long the device
    // sat free while an evaluation of it waited or started.
    let (st, info) = call(&s, "GET", "/v1/info", None).await;
    assert_eq!(st, StatusCode::OK, "{info}");
    let starved = info["device_slots"][0]["starved_s"].as_f64().unwrap();
    assert!(starved >= 0.0, "{info}");
    assert_eq!(
        info["capacity"]["prestart_depth"],
        env_server::DEFAULT_PRESTART_DEPTH,
        "{info}"
    );
}
