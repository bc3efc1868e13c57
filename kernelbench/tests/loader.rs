//! The loader on the bundled suite and on directories with broken files.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kernelbench::{TaskError, TaskSet};

#[test]
fn bundled_suite_has_all_levels_and_stable_ids() {
    let set = TaskSet::bundled();
    assert!(set.len() >= 60, "{}", set.len());
    for level in ["level1", "level2", "level3"] {
        assert!(set.split(level).len() >= 8, "{level}");
    }
    let relu = set.get("L1/1_ReLU").unwrap();
    assert_eq!(relu.level, 1);
    assert_eq!(relu.hash.len(), 64);
    assert_eq!(set.splits(), ["all", "level1", "level2", "level3"]);
    assert!(!set.split("level3").is_empty());
    let a = set.sample("all", 7).unwrap().id.clone();
    assert_eq!(
        set.sample("all", 7).unwrap().id,
        a,
        "sampling is deterministic"
    );
    assert!(matches!(
        set.sample("level9", 0),
        Err(TaskError::EmptySplit(_))
    ));
}

#[test]
fn kernelbench_layout_and_broken_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("level2")).unwrap();
    let good = "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n";
    std::fs::write(dir.path().join("level2/7_Good.py"), good).unwrap();
    let set = TaskSet::load_dir(dir.path()).unwrap();
    assert_eq!(set.get("L2/7_Good").unwrap().level, 2);
    std::fs::write(dir.path().join("level2/8_Broken.py"), "class Model: pass\n").unwrap();
    let err = TaskSet::load_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("8_Broken.py"), "{err}");
    assert!(
        err.contains("get_inputs()") && err.contains("get_init_inputs()"),
        "{err}"
    );
}
