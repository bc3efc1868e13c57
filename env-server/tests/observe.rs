//! The outside observer against real processes: samples resolve to the library a thread was
//! executing, through threads and children started after it attached and programs they exec;
//! windows select samples by time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};

use env_server::observe::{pytorch_compute, Finding, ObserveError, Observer, Profile, Tree};

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Attaches, or says why this machine cannot observe (not root, no perf events): the
/// evaluation then reports the observation missing, which `observation_missing_is_said`
/// covers.
fn attach_or_skip(pid: u32) -> Option<Observer> {
    match Observer::attach(&[Tree {
        root: pid,
        uid: None,
    }]) {
        Ok(o) => Some(o),
        Err(e @ ObserveError::Open { .. }) => {
            eprintln!("SKIPPED: this machine does not let the server observe: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn samples_follow_children_and_execs_started_after_attaching() {
    // The root sleeps while the observer attaches; then it forks a child that execs md5sum
    // (its work is in md5sum's own code) and itself spins in the shell.
    let mut root = Command::new("sh")
        .args([
            "-c",
            "sleep 0.5; timeout 1.5 md5sum /dev/zero & \
             end=$(($(date +%s) + 2)); while [ $(date +%s) -lt $end ]; do :; done; wait",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let Some(obs) = attach_or_skip(root.id()) else {
        let _ = root.kill();
        let _ = root.wait();
        return;
    };
    let start = now_ns();
    root.wait().unwrap();
    let end = now_ns();
    let rec = obs.finish().remove(0);
    let all = rec.profile(&[[start, end]]);
    println!("{all:?} lost {}", rec.lost);
    assert!(all.samples > 500, "{all:?}");
    let md5 = all.by_library.get("md5sum").copied().unwrap_or(0);
    assert!(
        md5 as f64 > 0.25 * all.samples as f64,
        "the exec'd child's samples resolve to its program: {all:?}"
    );
    let unknown = all.by_library.get("[unknown]").copied().unwrap_or(0);
    assert!(
        (unknown as f64) < 0.05 * all.samples as f64,
        "nearly every address resolves: {all:?}"
    );
    // A window before anything ran holds nothing; windows cover only their own time.
    assert_eq!(rec.profile(&[[start - 10, start - 5]]).samples, 0);
    let half = rec.profile(&[[start, start + (end - start) / 2]]).samples;
    assert!(half > 0 && half < all.samples, "{half} of {}", all.samples);
}

#[test]
fn threads_started_later_are_observed() {
    // A Python whose main thread waits while the observer attaches, then spins in two new
    // threads inside the C library (memset through ctypes, which releases the GIL).
    let code = "import ctypes, threading, time\n\
                time.sleep(0.5)\n\
                buf = ctypes.create_string_buffer(1 << 22)\n\
                def spin():\n    t = time.time()\n    while time.time() - t < 1.0:\n        ctypes.memset(buf, 1, len(buf))\n\
                ts = [threading.Thread(target=spin) for _ in range(2)]\n\
                [t.start() for t in ts]\n[t.join() for t in ts]\n";
    let python = std::env::var("CUDA_AGENT_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut root = Command::new(python).args(["-c", code]).spawn().unwrap();
    let Some(obs) = attach_or_skip(root.id()) else {
        let _ = root.kill();
        let _ = root.wait();
        return;
    };
    root.wait().unwrap();
    let rec = obs.finish().remove(0);
    let p = rec.profile(&[[0, u64::MAX]]);
    println!("{p:?}");
    let libc_share = p.share(|l| l.starts_with("libc.so"));
    assert!(libc_share > 0.5, "the new threads' memset: {p:?}");
}

/// A profile of 10 forwards with `torch` samples in PyTorch's compute library (on `pages`,
/// spread evenly) and `other` in an extension.
fn profile(pages: &[u64], torch: u64, other: u64) -> Profile {
    let mut p = Profile {
        forwards: 10,
        samples: torch + other,
        by_library: [
            ("libtorch_cpu.so".to_string(), torch),
            ("ext.so".to_string(), other),
        ]
        .into_iter()
        .collect(),
        ..Profile::default()
    };
    for (i, page) in pages.iter().enumerate() {
        let n = torch / pages.len() as u64 + u64::from((i as u64) < torch % pages.len() as u64);
        p.torch_pages
            .insert(("libtorch_cpu.so".to_string(), *page), n);
    }
    p
}

#[test]
fn the_rule_looks_where_the_reference_computes() {
    // The eager reference of an elementwise task: 55% in its kernel's pages 10-11, the rest
    // the worker's own copy of the output.
    let reference = profile(&[10, 11], 55, 45);
    // An honest candidate: its extension does the work; the dispatcher for its output is 1%.
    let honest = pytorch_compute(&profile(&[3], 1, 99), &reference);
    assert_eq!(honest.outcome, Finding::Clear, "{honest:?}");
    // One that also clones its inputs and zero-fills a buffer: a third of its time in
    // PyTorch, in the copy and fill kernels' pages, none in the task's kernel.
    let copies = pytorch_compute(&profile(&[40, 41, 60], 35, 65), &reference);
    assert_eq!(copies.outcome, Finding::Clear, "{copies:?}");
    // PyTorch's own kernel under any disguise: as much time per forward in the reference's
    // pages, here a smaller share since the judge compares the candidate's inputs after each
    // call.
    let hidden = pytorch_compute(&profile(&[10, 11], 55, 90), &reference);
    assert_eq!(hidden.outcome, Finding::Broken, "{hidden:?}");
    assert!((hidden.kernel_time_ratio - 1.0).abs() < 1e-9);
    // The same diluted with busy work of its own: a fifth of its time, the same time per call.
    let diluted = pytorch_compute(&profile(&[10, 11], 55, 220), &reference);
    assert!(diluted.candidate_kernel_share < 0.25, "{diluted:?}");
    assert_eq!(diluted.outcome, Finding::Broken, "{diluted:?}");
    // Time per forward: the same samples over four times the forwards is a quarter of the time.
    let mut spread = profile(&[10, 11], 55, 45);
    spread.forwards = 40;
    let spread = pytorch_compute(&spread, &reference);
    assert!((spread.kernel_time_ratio - 0.25).abs() < 1e-9);
    assert_eq!(spread.outcome, Finding::Clear, "{spread:?}");
    // Other kernels of PyTorch doing all the work.
    let other = pytorch_compute(&profile(&[70, 71], 70, 30), &reference);
    assert_eq!(other.outcome, Finding::Broken, "{other:?}");
    // Too few samples, or a reference whose compute did not show: nothing is decided.
    assert!(matches!(
        pytorch_compute(&profile(&[10], 20, 0), &reference).outcome,
        Finding::Inconclusive(_)
    ));
    assert!(matches!(
        pytorch_compute(&profile(&[10], 90, 10), &profile(&[10], 10, 90)).outcome,
        Finding::Inconclusive(_)
    ));
    // OpenMP's idle spinning counts for neither side.
    let mut spun = profile(&[10], 50, 50);
    spun.by_library.insert("libgomp-a34b3233.so.1".into(), 100);
    spun.samples += 100;
    assert!((spun.share(env_server::observe::is_torch_compute) - 0.5).abs() < 1e-9);
}

#[test]
fn online_cpu_lists_parse() {
    use env_server::observe::parse_cpu_list;
    assert_eq!(parse_cpu_list("0-1"), vec![0, 1]);
    assert_eq!(parse_cpu_list("0-3,6-7,9"), vec![0, 1, 2, 3, 6, 7, 9]);
    assert_eq!(parse_cpu_list("0"), vec![0]);
    assert!(parse_cpu_list("3-1").is_empty());
    assert!(parse_cpu_list("x").is_empty());
}

#[test]
fn trees_are_kept_apart_and_the_rest_of_the_machine_out() {
    // Two observed trees, each forking a checksum program after the observer attached, and a
    // third program nobody observes, all busy at once.
    let spawn = |prog: &str| {
        Command::new("sh")
            .args(["-c", &format!("sleep 0.3; timeout 1.5 {prog} /dev/zero")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut outsider = spawn("sha1sum");
    let (mut a, mut b) = (spawn("md5sum"), spawn("cksum"));
    let tree = |root| Tree { root, uid: None };
    let obs = match Observer::attach(&[tree(a.id()), tree(b.id())]) {
        Ok(o) => o,
        Err(e @ ObserveError::Open { .. }) => {
            eprintln!("SKIPPED: this machine does not let the server observe: {e}");
            for c in [&mut a, &mut b, &mut outsider] {
                let _ = c.kill();
                let _ = c.wait();
            }
            return;
        }
        Err(e) => panic!("{e}"),
    };
    for c in [&mut a, &mut b, &mut outsider] {
        c.wait().unwrap();
    }
    let recs = obs.finish();
    let (pa, pb) = (
        recs[0].profile(&[[0, u64::MAX]]),
        recs[1].profile(&[[0, u64::MAX]]),
    );
    println!("{pa:?}\n{pb:?}");
    let has = |p: &Profile, l: &str| p.by_library.get(l).copied().unwrap_or(0);
    assert!(
        has(&pa, "md5sum") > 100 && has(&pb, "cksum") > 100,
        "{pa:?} {pb:?}"
    );
    for (p, other) in [(&pa, "cksum"), (&pb, "md5sum")] {
        assert_eq!(has(p, other), 0, "the other tree's samples: {p:?}");
        assert_eq!(has(p, "sha1sum"), 0, "a process outside both trees: {p:?}");
    }
}

#[test]
fn a_child_made_the_sibling_of_its_creator_is_still_observed() {
    // CLONE_PARENT makes the child its creator's sibling (its parent is the test's process,
    // outside the tree): the kernel's fork record still names the creator, so its samples
    // count for the tree.
    let code = "import ctypes, os, time\n\
                libc = ctypes.CDLL(None, use_errno=True)\n\
                time.sleep(0.5)\n\
                import platform\n\
                nr = {'x86_64': 56, 'aarch64': 220}[platform.machine()]\n\
                pid = libc.syscall(nr, 0x8000 | 17, 0, 0, 0, 0)\n\
                if pid == 0:\n    buf = ctypes.create_string_buffer(1 << 22)\n    t = time.time()\n    \
                while time.time() - t < 1.0:\n        ctypes.memset(buf, 1, len(buf))\n    os._exit(0)\n\
                assert pid > 0, ctypes.get_errno()\n\
                time.sleep(1.3)\n";
    let python = std::env::var("CUDA_AGENT_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut root = Command::new(python).args(["-c", code]).spawn().unwrap();
    let Some(obs) = attach_or_skip(root.id()) else {
        let _ = root.kill();
        let _ = root.wait();
        return;
    };
    assert!(root.wait().unwrap().success());
    let p = obs.finish().remove(0).profile(&[[0, u64::MAX]]);
    println!("{p:?}");
    let libc_samples = p
        .by_library
        .iter()
        .filter(|(l, _)| l.starts_with("libc.so"))
        .map(|(_, n)| n)
        .sum::<u64>();
    // Its second of memset, less what other tests on this machine's cores take of it.
    assert!(
        libc_samples > 100 && libc_samples as f64 > 0.5 * p.samples as f64,
        "the sibling's memset: {p:?}"
    );
}
