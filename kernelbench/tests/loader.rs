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

/// The `clue` family: the word is only in the workspace's clue.txt, never in the prompt, and
/// the two recall families are separate splits.
#[test]
fn clue_family_hides_the_word_in_a_given_file() {
    let set = kernelbench::TaskSet::default().with_tiny_family();
    assert_eq!(set.splits(), ["all", "tiny", "clue"]);
    assert_eq!(set.split("tiny").len(), kernelbench::TINY_WORDS.len());
    let clue = set.split("clue");
    assert_eq!(clue.len(), kernelbench::CLUE_WORDS.len());
    for t in clue {
        let kernelbench::TaskKind::Recall { value, given, .. } = &t.kind else {
            panic!("{} is not a recall task", t.id);
        };
        assert!(!t.source.contains(value.as_str()), "{}", t.source);
        assert!(!t.id.contains(value.as_str()), "{}", t.id);
        assert_eq!(given, &vec![("clue.txt".to_string(), format!("{value}\n"))]);
    }
}
