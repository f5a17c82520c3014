//! The wire load generator (`cargo bench --bench lighthouse_load`) in its `--quick` mode, so
//! the bench keeps working: every round kind and the rooms mode against the real daemon.

#[path = "../benches/lighthouse_load/load.rs"]
#[allow(dead_code)]
mod load;

/// Bound on the quick run: a hang fails the test instead of blocking the suite.
const QUICK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(240);

#[test]
fn quick_load_runs_every_round_kind() {
    let opts = load::Options::quick(env!("CARGO_BIN_EXE_torchft_lighthouse").into());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(load::run(&opts).map_err(|e| e.to_string()));
    });
    let report = rx
        .recv_timeout(QUICK_TIMEOUT)
        .unwrap_or_else(|_| panic!("the quick load run did not end within {QUICK_TIMEOUT:?}"))
        .expect("the quick load run fails");
    let text = report.lines.join("\n");
    for needle in ["first", "steady", "change", "peak RSS", "rooms ratio"] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
    assert!(report.missed.is_empty(), "quick mode judges nothing");
}

#[test]
fn bad_arguments_are_refused_with_a_message() {
    let parse = |args: &[&str]| {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        load::Options::parse(&args, "daemon".into())
    };
    for (args, message) in [
        (
            &["--room-trials", "0"][..],
            "--room-trials must be at least 1",
        ),
        (
            &["--room-groups", "0"][..],
            "--room-groups must be at least 1",
        ),
        (&["--room-trials", "many"][..], "--room-trials"),
        (&["--frobnicate"][..], "unknown argument"),
    ] {
        let err = parse(args).expect_err("refused");
        assert!(err.to_string().contains(message), "{args:?}: {err}");
    }
    // No rooms: the per-room settings are not needed.
    let opts = parse(&["--rooms", "0", "--room-trials", "0"]).expect("accepted");
    assert_eq!((opts.rooms, opts.room_trials), (0, 0));
    assert_eq!(
        parse(&["--room-trials", "3"])
            .expect("accepted")
            .room_trials,
        3
    );
}
