//! The wire load generator (`cargo bench --bench lighthouse_load`) in its `--quick` mode, so
//! the bench keeps working: every round kind and the rooms mode against the real daemon.

#[path = "../benches/lighthouse_load/load.rs"]
#[allow(dead_code)]
mod load;

#[test]
fn quick_load_runs_every_round_kind() {
    let started = std::time::Instant::now();
    let opts = load::Options::quick(env!("CARGO_BIN_EXE_torchft_lighthouse").into());
    let report = load::run(&opts).expect("the quick load run fails");
    let text = report.lines.join("\n");
    for needle in ["first", "steady", "change", "peak RSS", "rooms ratio"] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
    assert!(report.missed.is_empty(), "quick mode judges nothing");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "the quick run took {:?}",
        started.elapsed()
    );
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
