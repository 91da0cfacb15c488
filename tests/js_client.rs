//! The JavaScript client, `clients/js` (the npm package `posthorn-client`): its own test suite,
//! run with Node's test runner against the hub binary of this build. It covers the event-stream
//! parser, the reconnect timing, token refresh and revocation against a scripted server, real
//! hubs (memory and Redis backends) and headless Chromium on another origin
//! (`clients/js/README.md`, "Tests").
//!
//! Needs `node` (20 or later; Debian 12's 18.20 runs the suite too) and `npm`, which
//! `scripts/test` installs from Debian when they are missing, plus `redis-server` and `chromium`
//! like the other tests. The dev dependencies are installed with `npm ci` only when
//! `node_modules` is missing or was installed from another `package-lock.json`, so a second run
//! needs no network.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The suite's size when this was written: a runner that found fewer tests (a file that no longer
/// loads, a glob that matches nothing) must not pass. Raise it when tests are added.
const MIN_PASSING: u64 = 68;

/// The suite takes about two minutes on two busy cores; a test that hangs despite its own
/// deadline (a process left running) must not hang `cargo test`.
const SUITE_DEADLINE: Duration = Duration::from_secs(15 * 60);

/// Where `npm ci` records the lockfile it installed from.
const INSTALLED_LOCK: &str = "node_modules/.posthorn-installed-lock.json";

fn client_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/js")
}

/// Runs a tool, failing the test with a clear message when it is not installed.
fn run(program: &str, args: &[&str], dir: &Path, envs: &[(&str, &str)]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(dir)
        .envs(envs.iter().copied())
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "cannot run {program} ({error}): the JavaScript client's tests need Node.js and npm; \
                 install them (apt-get install nodejs npm; scripts/test does)"
            )
        })
}

fn text(output: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_success(what: &str, output: &Output) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}",
        output.status,
        text(output)
    );
}

/// Runs `command` in a process group of its own and collects its output; after `deadline` the
/// whole group (the runner, its test processes, the hubs and browsers they started) is killed
/// and the test fails with what was printed so far.
fn run_with_deadline(command: &mut Command, deadline: Duration) -> Output {
    let mut child = command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot run node ({error}): install nodejs and npm"));
    let collect = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = collect(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = collect(Box::new(child.stderr.take().expect("piped stderr")));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for node") {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = Command::new("kill")
                .args(["-KILL", &format!("-{}", child.id())])
                .status();
            let output = Output {
                status: child.wait().expect("reap node"),
                stdout: stdout.join().unwrap_or_default(),
                stderr: stderr.join().unwrap_or_default(),
            };
            panic!(
                "node --test still running after {deadline:?}; killed:\n{}",
                text(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// `npm ci` unless `node_modules` holds what the current lockfile names.
fn install_dependencies(dir: &Path) {
    let lock = std::fs::read(dir.join("package-lock.json")).expect("clients/js/package-lock.json");
    let installed = std::fs::read(dir.join(INSTALLED_LOCK)).ok();
    if dir.join("node_modules").is_dir() && installed.as_deref() == Some(lock.as_slice()) {
        return;
    }
    let output = run(
        "npm",
        &["ci", "--no-audit", "--no-fund", "--prefer-offline"],
        dir,
        &[],
    );
    assert_success("npm ci", &output);
    std::fs::write(dir.join(INSTALLED_LOCK), &lock).expect("record the installed lockfile");
}

/// The `# name N` counters at the end of the runner's TAP output.
fn counter(tap: &str, name: &str) -> Option<u64> {
    tap.lines().rev().find_map(|line| {
        line.strip_prefix("# ")?
            .strip_prefix(name)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The whole `clients/js` suite passes against this build's hub, and it really ran.
#[test]
fn javascript_client_suite() {
    let dir = client_dir();
    let version = run("node", &["--version"], &dir, &[]);
    assert_success("node --version", &version);
    let version = String::from_utf8_lossy(&version.stdout).trim().to_owned();
    let major: u32 = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|major| major.parse().ok())
        .unwrap_or(0);
    // The package asks for 20 or later; 18.20, Debian 12's, runs the suite too (README.md, "Tests").
    assert!(
        major >= 18,
        "Node.js {version} is too old: the client's tests need 18.20 or later"
    );

    install_dependencies(&dir);
    assert_success("npm run build", &run("npm", &["run", "build"], &dir, &[]));

    let mut files: Vec<String> = std::fs::read_dir(dir.join("test"))
        .expect("clients/js/test")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.ends_with(".test.mjs").then(|| format!("test/{name}"))
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no test files in clients/js/test");
    let mut args = vec!["--test", "--test-reporter=tap"];
    args.extend(files.iter().map(String::as_str));
    let output = run_with_deadline(
        Command::new("node")
            .args(&args)
            .current_dir(&dir)
            .env("POSTHORN_BIN", env!("CARGO_BIN_EXE_posthorn")),
        SUITE_DEADLINE,
    );
    let tap = String::from_utf8_lossy(&output.stdout).into_owned();
    let report = text(&output);
    assert_success("node --test", &output);
    let count = |name: &str| {
        counter(&tap, name)
            .unwrap_or_else(|| panic!("no `# {name}` line in the runner's output:\n{report}"))
    };
    let (tests, pass) = (count("tests"), count("pass"));
    for name in ["fail", "cancelled", "skipped", "todo"] {
        assert_eq!(count(name), 0, "{name} tests:\n{report}");
    }
    assert_eq!(pass, tests, "{report}");
    assert!(
        pass >= MIN_PASSING,
        "only {pass} tests passed, expected at least {MIN_PASSING}:\n{report}"
    );
}
