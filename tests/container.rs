//! The container image (Dockerfile) and the Kubernetes manifests (deploy/k8s/) that run it.
//!
//! File checks, which need nothing installed: the Dockerfile's dependency stage copies every
//! workspace member (read from Cargo.toml, so a new crate is covered the day it is added),
//! every path it copies exists in the build context, and the manifests' ports, probes, user
//! and stop time agree with the Dockerfile and with `drain.grace`.
//!
//! Image checks, as root with podman and mmdebstrap (scripts/test installs them): podman builds
//! the Dockerfile's `runtime-prebuilt` target around the binary this test run compiled, on a
//! local stand-in for `debian:bookworm-slim`. Containers cannot be started on this kernel's
//! cgroup setup, so the tests mount the image and run its own binary, configuration and curl
//! with chroot, as the user, with the environment, entrypoint, command, stop signal and
//! HEALTHCHECK that `podman image inspect` reports: the image is checked, not a copy of its
//! settings. What a container adds (its own PID, mount and, except where said, network
//! namespaces) is not exercised, nor is the `build` stage: `rust:1-bookworm` cannot be pulled
//! here, and the file checks cover what that stage copies.

mod support;

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use support::{free_port, http, stream_path, SseClient};

const BIN: &str = env!("CARGO_BIN_EXE_posthorn");
const REPO: &str = env!("CARGO_MANIFEST_DIR");
/// Failure guard for a command run from the image and for the hub's start-up.
const WAIT: Duration = Duration::from_secs(20);
/// EX_USAGE: what the hub exits with when it refuses its configuration.
const EX_USAGE: i32 = 64;
/// How long the hub may take to stop its HTTP server after the drain (src/http/server.rs,
/// STOP_TIMEOUT; docs/operations.md: "a drain may take drain.grace plus up to 2 s").
const SERVER_STOP_TIMEOUT: Duration = Duration::from_secs(2);

// ---- file checks ------------------------------------------------------------------------------

/// Every workspace member of Cargo.toml (and every path dependency or patch they name) gets its
/// manifest and a placeholder for each of its targets in the Dockerfile's dependency stage, at
/// the same place as in the repository, and its sources, touched, in the stage's second build;
/// otherwise `docker build` fails on the manifest or builds a placeholder into the image.
#[test]
fn the_dependency_stage_copies_every_workspace_member() {
    let dockerfile = Dockerfile::read();
    let build = dockerfile.build_stage();
    let first_build = build
        .iter()
        .position(|i| i.keyword == "RUN" && i.args.contains("cargo build"))
        .expect("the build stage runs `cargo build` for the dependencies");
    let (dependencies, sources) = build.split_at(first_build + 1);
    let second_build = sources
        .iter()
        .find(|i| i.keyword == "RUN" && i.args.contains("cargo build"))
        .expect("the build stage runs `cargo build` again with the real sources");
    let placeholders = shell_words(&dependencies[first_build].args);
    let touched = shell_words(&second_build.args);
    let workdir = &dependencies[first_build].workdir;
    // Where cargo looks for `path`: under the WORKDIR of the build.
    let lands = |part: &[&Instruction], path: &str| {
        let expected = normalize(&workdir.join(path));
        part.iter().any(|i| {
            i.copy()
                .filter(|c| c.from.is_none())
                .and_then(|c| c.lands_at(path, &i.workdir))
                == Some(expected.clone())
        })
    };

    let root = read_manifest("Cargo.toml");
    let members = workspace_members(&root);
    assert!(
        members.iter().any(|m| m.is_empty()),
        "the root package is a member"
    );
    let mut problems = Vec::new();
    for member in &members {
        let manifest = read_manifest(&join(member, "Cargo.toml"));
        let shown = if member.is_empty() { "." } else { member };
        if !lands(dependencies, &join(member, "Cargo.toml")) {
            problems.push(format!(
                "member {shown}: {} is not copied before the first `cargo build`",
                join(member, "Cargo.toml")
            ));
        }
        for target in member_targets(member, &manifest) {
            let path = join(member, &target);
            if !placeholders.contains(&path) && !lands(dependencies, &path) {
                problems.push(format!(
                    "member {shown}: no placeholder for its target {path} in the dependency stage"
                ));
            }
        }
        let build_script = manifest_build_script(member, &manifest);
        if let Some(script) = build_script {
            if !lands(dependencies, &script) {
                problems.push(format!(
                    "member {shown}: its build script {script} is not copied"
                ));
            }
        }
        for source in ["src/lib.rs", "src/main.rs"] {
            let path = join(member, source);
            if !Path::new(REPO).join(&path).exists() {
                continue;
            }
            if !lands(sources, &path) {
                problems.push(format!(
                    "member {shown}: {path} is not copied for the second `cargo build`"
                ));
            }
            if !touched.contains(&path) {
                problems.push(format!(
                    "member {shown}: {path} is not touched before the second `cargo build` \
                     (COPY keeps mtimes older than the placeholder's: cargo would keep the \
                     placeholder build)"
                ));
            }
        }
        for dependency in path_dependencies(member, &manifest) {
            if members.contains(&dependency) {
                continue;
            }
            let dependency_manifest = read_manifest(&join(&dependency, "Cargo.toml"));
            let needed = std::iter::once("Cargo.toml".to_string())
                .chain(member_targets(&dependency, &dependency_manifest));
            for path in needed.map(|file| join(&dependency, &file)) {
                if !lands(dependencies, &path) {
                    problems.push(format!(
                        "member {shown}: {path} of its path dependency {dependency} is not \
                         copied into the dependency stage"
                    ));
                }
            }
        }
    }
    for patch in patch_paths(&root) {
        if !lands(dependencies, &join(&patch, "Cargo.toml")) {
            problems.push(format!(
                "the patched crate {patch} ([patch] in Cargo.toml) is not copied into the \
                 dependency stage"
            ));
        }
    }
    if !lands(dependencies, "Cargo.lock") {
        problems.push("Cargo.lock is not copied (the build is --locked)".to_string());
    }
    assert!(
        problems.is_empty(),
        "the Dockerfile misses workspace members of {:?}:\n  {}",
        members
            .iter()
            .map(|m| if m.is_empty() { "." } else { m.as_str() })
            .collect::<Vec<_>>(),
        problems.join("\n  ")
    );
}

/// Every path the Dockerfile copies from the build context exists in the repository and is not
/// left out of the context by .dockerignore.
#[test]
fn every_path_the_dockerfile_copies_from_the_context_exists() {
    let dockerfile = Dockerfile::read();
    let ignore = DockerIgnore::read();
    let mut copied = 0;
    let mut problems = Vec::new();
    for instruction in &dockerfile.instructions {
        let Some(copy) = instruction.copy() else {
            continue;
        };
        // Another stage, or a named build context (runtime-prebuilt's binary).
        if copy.from.is_some() {
            continue;
        }
        for source in &copy.sources {
            copied += 1;
            let path = normalize(Path::new(source));
            let shown = format!(
                "line {}: {} {source}",
                instruction.line, instruction.keyword
            );
            if source.contains(['*', '?', '[']) {
                problems.push(format!(
                    "{shown}: a pattern; this check reads literal paths only"
                ));
            } else if !Path::new(REPO).join(&path).exists() {
                problems.push(format!("{shown}: no such path in the repository"));
            } else if let Some(pattern) = ignore.excludes(&path) {
                problems.push(format!("{shown}: excluded by .dockerignore ({pattern})"));
            }
        }
    }
    assert!(copied > 0, "no COPY from the build context found");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// deploy/k8s/ agrees with the image and the drain: the container port is the Dockerfile's
/// EXPOSE and the port of its listen address and HEALTHCHECK; the probes use that port, liveness
/// and start-up the HEALTHCHECK's path; the pod runs as the Dockerfile's USER; the Service and
/// the Prometheus annotation point at that port; with no `preStop` hook,
/// terminationGracePeriodSeconds covers drain.grace plus the server's stop timeout, and
/// drain.readiness_delay covers the readiness probe's period times its failure threshold (grace
/// and delay from deployment.yaml's environment, else config/posthorn.toml).
#[test]
fn the_k8s_manifests_agree_with_the_image_and_the_drain() {
    let dockerfile = Dockerfile::read();
    let image = dockerfile.runtime_settings();
    let deployment = Yaml::read("deploy/k8s/deployment.yaml");
    let service = Yaml::read("deploy/k8s/service.yaml");

    // The ports.
    let (port_name, container_port) = deployment.container_port();
    assert_eq!(
        image.exposed,
        vec![container_port],
        "the Dockerfile EXPOSEs the deployment's containerPort"
    );
    assert_eq!(
        image.listen_port, container_port,
        "the Dockerfile's POSTHORN_SERVER__LISTEN uses the exposed port"
    );
    assert_eq!(
        image.healthcheck_port, container_port,
        "the HEALTHCHECK calls the exposed port"
    );
    let env = deployment.env();
    if let Some(listen) = env.get("POSTHORN_SERVER__LISTEN") {
        let port = listen.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
        assert_eq!(
            port,
            Some(Ok(container_port)),
            "deployment.yaml's POSTHORN_SERVER__LISTEN {listen} is not on the containerPort"
        );
    }
    let port_of = |port: &str| {
        if port == port_name {
            container_port
        } else {
            port.parse()
                .unwrap_or_else(|_| panic!("probe port {port} is neither {port_name} nor a number"))
        }
    };
    let probes = deployment.probes();
    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
        let found = probes
            .get(probe)
            .unwrap_or_else(|| panic!("deployment.yaml has no {probe} with httpGet"));
        assert_eq!(
            port_of(&found.port),
            container_port,
            "{probe} probes the container port"
        );
    }
    for probe in ["livenessProbe", "startupProbe"] {
        assert_eq!(
            probes[probe].path, image.healthcheck_path,
            "{probe} checks what the image's HEALTHCHECK checks"
        );
    }
    assert_eq!(
        deployment.value("prometheus.io/port").as_deref(),
        Some(container_port.to_string().as_str()),
        "the scrape annotation names the container port"
    );
    let target_port = service
        .value("targetPort")
        .expect("service.yaml has a targetPort");
    assert_eq!(
        port_of(&target_port),
        container_port,
        "the Service sends to the container port"
    );

    // The user.
    for (key, expected) in [("runAsUser", image.uid), ("runAsGroup", image.gid)] {
        let values = deployment.values(key);
        assert!(!values.is_empty(), "deployment.yaml sets no {key}");
        for value in values {
            assert_eq!(
                value.parse::<u32>().ok(),
                Some(expected),
                "{key} is the Dockerfile's USER"
            );
        }
    }

    // The drain.
    assert_eq!(
        image.stop_signal, "SIGTERM",
        "the Dockerfile's STOPSIGNAL is the signal that drains"
    );
    let defaults = read_config_defaults();
    let setting = |key: &str| {
        let env_key = format!("POSTHORN_DRAIN__{}", key.to_ascii_uppercase());
        let value = env.get(&env_key).cloned().unwrap_or_else(|| {
            defaults["drain"][key]
                .as_str()
                .unwrap_or_else(|| panic!("config/posthorn.toml has no drain.{key}"))
                .to_string()
        });
        parse_duration(&value)
    };
    let grace = setting("grace");
    let readiness_delay = setting("readiness_delay");
    assert!(
        deployment.value("preStop").is_none(),
        "deployment.yaml has a preStop hook: its time counts against \
         terminationGracePeriodSeconds, which this check (and deploy/k8s/README.md) do not \
         allow for"
    );
    let termination = Duration::from_secs(
        deployment
            .value("terminationGracePeriodSeconds")
            .expect("deployment.yaml sets terminationGracePeriodSeconds")
            .parse()
            .expect("terminationGracePeriodSeconds is a number"),
    );
    assert!(
        termination >= grace + SERVER_STOP_TIMEOUT,
        "terminationGracePeriodSeconds {termination:?} is shorter than drain.grace {grace:?} plus \
         the server's stop timeout {SERVER_STOP_TIMEOUT:?}: the kubelet would SIGKILL a drain"
    );
    let readiness = &probes["readinessProbe"];
    let unready_after = readiness.unready_after();
    assert!(
        readiness_delay >= unready_after,
        "drain.readiness_delay {readiness_delay:?} is shorter than the readiness probe's period \
         x failureThreshold ({unready_after:?}): streams would still be routed to a pod that \
         has begun to close them"
    );
    assert!(
        readiness_delay < grace,
        "drain.readiness_delay counts inside drain.grace"
    );
}

// ---- image checks -----------------------------------------------------------------------------

/// The image holds the binary this test run compiled and the repository's
/// config/posthorn.toml at the path its CMD names, both root-owned and not writable by the
/// image's user, which is the uid and gid deployment.yaml runs as; `config check` as that user
/// accepts that file (with the listen address moved to loopback); and the image has the CA
/// bundle that TLS links without a CA file (rediss://, tls:// NATS) read the system's roots from.
#[tokio::test]
async fn the_image_holds_the_binary_and_the_configuration_for_its_user() {
    let image = Image::build();
    let (uid, gid) = image.user_ids();
    assert_eq!(
        (uid, gid),
        deployment_user(),
        "the image's USER ({:?}) is the user deployment.yaml runs as",
        image.config.user
    );
    assert_ne!(uid, 0, "the image runs as root");

    let entrypoint = image.config.entrypoint.first().expect("an ENTRYPOINT");
    let binary = image.path(entrypoint);
    assert!(
        std::fs::read(&binary).expect("read the image's binary")
            == std::fs::read(BIN).expect("read the binary under test"),
        "{entrypoint} in the image is not {BIN}"
    );
    let config_path = image.config_file();
    let config = image.path(&config_path);
    assert_eq!(
        std::fs::read_to_string(&config)
            .unwrap_or_else(|e| panic!("{config_path} in the image: {e}")),
        std::fs::read_to_string(Path::new(REPO).join("config/posthorn.toml")).unwrap(),
        "{config_path} in the image is the repository's config/posthorn.toml"
    );
    for (path, file) in [
        (entrypoint.as_str(), &binary),
        (config_path.as_str(), &config),
    ] {
        let meta = std::fs::metadata(file).unwrap();
        assert_eq!(meta.uid(), 0, "{path} is owned by root");
        // COPY keeps the checkout's mode bits, which depend on the umask it was made with.
        let writable = (meta.gid() == gid && meta.mode() & 0o020 != 0) || meta.mode() & 0o002 != 0;
        assert!(
            !writable,
            "{path} is writable by the image's user (mode {:o}, group {})",
            meta.mode(),
            meta.gid()
        );
    }

    let loopback = format!("127.0.0.1:{}", free_port());
    let check = image
        .run(
            &image.config_command("check"),
            &[("POSTHORN_SERVER__LISTEN", &loopback)],
        )
        .await;
    assert_eq!(
        check.status.code(),
        Some(0),
        "config check as the image's user: {}",
        output_text(&check)
    );
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(
        stdout.contains(&format!(
            "configuration ok: {config_path} with the environment"
        )),
        "config check names the image's file: {stdout}"
    );

    let bundle = image.path("/etc/ssl/certs/ca-certificates.crt");
    let certificates = std::fs::read_to_string(&bundle).unwrap_or_default();
    assert!(
        certificates.matches("BEGIN CERTIFICATE").count() > 10,
        "no CA bundle at /etc/ssl/certs/ca-certificates.crt: is ca-certificates installed?"
    );
}

/// As the Dockerfile's comment promises, the image as it is (its ENV listens on 0.0.0.0 with
/// auth.mode = none) refuses to serve: `serve` exits 64 naming the way out. It runs in a network
/// namespace of its own, so that a hub that did not refuse would not serve on this machine.
#[tokio::test]
async fn the_image_refuses_a_public_listen_address_without_auth() {
    let image = Image::build();
    let listen = image.env("POSTHORN_SERVER__LISTEN");
    let output = image.run_private_net(&image.serve_command(), &[]).await;
    assert_eq!(
        output.status.code(),
        Some(EX_USAGE),
        "serve with the image's own settings: {}",
        output_text(&output)
    );
    let text = output_text(&output);
    assert!(
        text.contains(&format!(
            "refusing to listen on {listen} with auth.mode = none"
        )) && text.contains("auth.mode = jwt")
            && text.contains("server.insecure"),
        "the refusal names the image's listen address and the two ways out: {text}"
    );
}

/// The image's HEALTHCHECK command, exactly as the image config holds it, passes within its
/// timeout against the image's hub in both modes the Dockerfile offers (jwt with a secret, and
/// server.insecure) and fails with nothing listening. The hub listens on the image's own
/// address (0.0.0.0 and the exposed port) in a network namespace of its own, where that port is
/// surely free, and the check runs in that namespace: no port is rewritten. Started as the
/// image's USER says, the hub runs as the uid and gid deployment.yaml expects (10001, read from
/// /proc/PID/status).
#[tokio::test]
async fn the_healthcheck_passes_against_the_image_hub_in_both_auth_modes() {
    let image = Image::build();
    let (uid, gid) = deployment_user();
    let secret = format!("container-test-secret-{}", std::process::id());
    let modes: [(&str, Vec<(&str, &str)>); 2] = [
        (
            "jwt",
            vec![
                ("POSTHORN_AUTH__MODE", "jwt"),
                ("POSTHORN_AUTH__JWT_SECRET", &secret),
            ],
        ),
        ("insecure", vec![("POSTHORN_SERVER__INSECURE", "true")]),
    ];
    let listen = image.env("POSTHORN_SERVER__LISTEN");
    for (mode, env) in modes {
        let mut hub = image.spawn_private_net(&image.serve_command(), &env, mode);
        let ready = format!("listening on http://{listen}");
        assert!(
            hub.wait_for_log(&ready, WAIT).await,
            "{mode}: the hub never logged {ready:?}:\n{}",
            hub.log()
        );
        assert_eq!(
            process_ids(hub.pid()),
            ((uid, uid), (gid, gid)),
            "{mode}: the hub runs as the user deployment.yaml expects (the image's USER)"
        );
        let check = image.healthcheck(Some(hub.pid())).await;
        assert_eq!(
            check.status.code(),
            Some(0),
            "{mode}: the HEALTHCHECK {:?} failed: {}",
            image.config.healthcheck,
            output_text(&check)
        );
    }
    // Nothing listens in a fresh namespace: the check must say so, or it proves nothing.
    let check = image.healthcheck(None).await;
    assert_eq!(
        check.status.code(),
        Some(1),
        "the HEALTHCHECK with no hub: {}",
        output_text(&check)
    );
}

/// The image's hub, started with its ENTRYPOINT, CMD, USER and environment (the listen address
/// moved to a free loopback port of this machine, the only override), runs as the uid and gid
/// deployment.yaml expects (10001), answers the probe paths of deployment.yaml, and on the
/// image's STOPSIGNAL drains: an open stream (`GET /v1/devices/pos-1/events`) gets a `retry:`
/// within drain.retry_min..retry_max and a clean end, and the process exits 0 within
/// drain.grace. Grace and the retry range are the effective configuration that `config show`
/// prints from the image's file.
#[tokio::test]
async fn the_stop_signal_drains_an_open_stream_and_exits_0_within_the_grace() {
    let image = Image::build();
    let (uid, gid) = deployment_user();
    let mut attempt = 0;
    let (mut hub, addr) = loop {
        attempt += 1;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let listen = addr.to_string();
        let mut hub = image.spawn(
            &image.serve_command(),
            &[("POSTHORN_SERVER__LISTEN", &listen)],
            "serve",
        );
        match hub.wait_ready(addr).await {
            Ok(()) => break (hub, addr),
            // Another process took the port between free_port and the bind.
            Err(log) if log.contains("Address already in use") && attempt < 3 => continue,
            Err(log) => panic!("the image's hub did not start on {addr}:\n{log}"),
        }
    };
    let listen = addr.to_string();
    let shown = image
        .run(
            &image.config_command("show"),
            &[("POSTHORN_SERVER__LISTEN", &listen)],
        )
        .await;
    assert!(
        shown.status.success(),
        "config show: {}",
        output_text(&shown)
    );
    let effective: toml::Table = String::from_utf8_lossy(&shown.stdout)
        .parse()
        .expect("config show prints TOML");
    let drain_setting = |key: &str| {
        parse_duration(
            effective["drain"][key]
                .as_str()
                .unwrap_or_else(|| panic!("config show has no drain.{key}")),
        )
    };
    let (grace, retry_min, retry_max) = (
        drain_setting("grace"),
        drain_setting("retry_min"),
        drain_setting("retry_max"),
    );

    assert_eq!(
        process_ids(hub.pid()),
        ((uid, uid), (gid, gid)),
        "the hub runs as the user deployment.yaml expects (the image's USER)"
    );
    for (probe, found) in Yaml::read("deploy/k8s/deployment.yaml").probes() {
        let response = http::get(addr, &found.path).await;
        assert_eq!(
            response.status,
            200,
            "{probe} {}: {}",
            found.path,
            response.text()
        );
    }

    let mut stream = SseClient::connect(addr, &stream_path("pos-1"), &[]).await;
    assert_eq!(stream.status(), 200, "the stream is open");
    let before_signal = stream.raw.len();
    let signaled = Instant::now();
    hub.signal(&image.config.stop_signal);
    stream.read_to_close(grace).await;
    let after = String::from_utf8_lossy(&stream.raw[before_signal..]).into_owned();
    let retry = after
        .lines()
        .filter_map(|line| line.strip_prefix("retry:"))
        .map(|ms| Duration::from_millis(ms.trim().parse().expect("retry: milliseconds")))
        .next_back()
        .unwrap_or_else(|| panic!("no retry: line after the stop signal: {after:?}"));
    assert!(
        (retry_min..=retry_max).contains(&retry),
        "the closing retry {retry:?} is outside drain.retry_min..retry_max"
    );
    assert!(
        stream.body_complete(),
        "the drain ends the response cleanly, it does not reset it"
    );
    let left = grace.saturating_sub(signaled.elapsed());
    let status = hub
        .wait_exit(left)
        .await
        .unwrap_or_else(|| panic!("still running {grace:?} (drain.grace) after the stop signal"));
    assert_eq!(status.code(), Some(0), "{}", hub.log());
}

// ---- the image --------------------------------------------------------------------------------

/// The stand-in for Docker Hub's `debian:bookworm-slim`, which this machine cannot pull, made
/// like that image: a minbase bootstrap of bookworm with its updates and security suites, PATH
/// and `bash` as its command; so no ca-certificates and no curl, which the runtime stage must
/// install itself.
const BASE_IMAGE: &str = "localhost/debian:bookworm-slim";
const BASE_SOURCES: [&str; 3] = [
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
];
const BASE_CHANGES: [&str; 2] = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "CMD [\"bash\"]",
];
/// Label holding the key of the recipe above on the stand-in, so that a stand-in made by another
/// recipe is made again. An image of that name without the label is someone's own base (a
/// `podman load`ed debian:bookworm-slim, say) and is used as it is.
const BASE_LABEL: &str = "org.posthorn.test-base";
/// The bootstrap takes about a minute and needs Debian's mirror, so its tarball is kept, once per
/// machine and recipe; delete the directory to bootstrap again.
const BASE_CACHE: &str = "/var/tmp/posthorn-container-base";
/// The runtime stage without the binary, tagged so that podman keeps its layers (the apt-get
/// step) for the next build; the test images themselves are removed.
const CACHE_TAG: &str = "localhost/posthorn-test:runtime-base";
const TEST_REPOSITORY: &str = "localhost/posthorn-test";

/// What `podman image inspect` says about the image.
#[derive(Debug, Default)]
struct ImageConfig {
    user: String,
    env: Vec<(String, String)>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    stop_signal: String,
    /// The HEALTHCHECK's `Test`: `["CMD-SHELL", command]` or `["CMD", argv...]`.
    healthcheck: Vec<String>,
    healthcheck_timeout: Duration,
}

/// The `runtime-prebuilt` image built around this test run's binary, mounted; unmounted and
/// untagged on drop.
#[derive(Debug)]
struct Image {
    podman_bin: PathBuf,
    tag: String,
    root: PathBuf,
    config: ImageConfig,
    context: PathBuf,
}

impl Image {
    fn build() -> Image {
        require_root();
        let podman = host_tool("podman");
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let tag = format!(
            "{TEST_REPOSITORY}:{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        // The binary comes in through a build context of its own (the Dockerfile's
        // runtime-prebuilt stage): a directory holding only it.
        let context = support::unique_temp_dir("container-context");
        let binary = context.join("posthorn");
        if std::fs::hard_link(BIN, &binary).is_err() {
            std::fs::copy(BIN, &binary).expect("copy the binary into the build context");
        }
        let mut image = Image {
            podman_bin: podman,
            tag,
            root: PathBuf::new(),
            config: ImageConfig::default(),
            context,
        };
        {
            // One bootstrap and one cache tag at a time, across test processes too.
            let _lock = lock_file(&Path::new(BASE_CACHE).join("lock"));
            image.remove_leftovers();
            image.ensure_base();
            let previous = image.id_of(CACHE_TAG);
            image.build_target("runtime-base", CACHE_TAG);
            if let (Some(previous), Some(current)) = (previous, image.id_of(CACHE_TAG)) {
                if previous != current {
                    // Fails, harmlessly, while a test image still builds on it.
                    let _ = image.podman(&["rmi", &previous]);
                }
            }
        }
        let tag = image.tag.clone();
        image.build_target("runtime-prebuilt", &tag);
        image.config = image.inspect();
        let mount = image
            .podman(&["image", "mount", &tag])
            .unwrap_or_else(|e| panic!("podman image mount {tag}: {e}"));
        image.root = PathBuf::from(mount.trim());
        assert!(
            image.root.join("usr").is_dir(),
            "podman image mount {tag} gave {}",
            image.root.display()
        );
        image
    }

    /// Runs podman with the cgroup manager this machine has (no systemd); stdout, or the
    /// command and its output.
    fn podman(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new(&self.podman_bin)
            .arg("--cgroup-manager=cgroupfs")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.podman_bin.display()));
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "podman {} failed ({}):\n{}",
                args.join(" "),
                output.status,
                output_text(&output)
            ))
        }
    }

    /// Unmounts and untags the images of test processes that are gone (killed before their
    /// drops ran), so that they do not pile up in podman's storage.
    fn remove_leftovers(&self) {
        let Ok(tags) = self.podman(&["images", "--format", "{{.Tag}}", TEST_REPOSITORY]) else {
            return;
        };
        for tag in tags.lines().map(str::trim) {
            // Test images are tagged PID-N; the cache tag is not.
            let Some(Ok(pid)) = tag.split_once('-').map(|(pid, _)| pid.parse::<u32>()) else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let image = format!("{TEST_REPOSITORY}:{tag}");
                let _ = self.podman(&["image", "unmount", "--force", &image]);
                let _ = self.podman(&["rmi", &image]);
            }
        }
    }

    fn id_of(&self, image: &str) -> Option<String> {
        self.podman(&["image", "inspect", "--format", "{{.Id}}", image])
            .ok()
            .map(|id| id.trim().to_string())
    }

    /// The stand-in base image in podman's storage: used if there, else imported from the
    /// cached tarball, else bootstrapped.
    fn ensure_base(&self) {
        let recipe = format!(
            "mmdebstrap --variant=minbase --format=tar bookworm\n{}\n{}",
            BASE_SOURCES.join("\n"),
            BASE_CHANGES.join("\n")
        );
        let key: String = Sha256::digest(recipe.as_bytes())[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if let Ok(labels) = self.podman(&[
            "image",
            "inspect",
            "--format",
            "{{json .Labels}}",
            BASE_IMAGE,
        ]) {
            let labels: Value = serde_json::from_str(labels.trim()).unwrap_or(Value::Null);
            match labels.get(BASE_LABEL).and_then(Value::as_str) {
                None => return,
                Some(found) if found == key => return,
                Some(_) => {}
            }
        }
        let dir = Path::new(BASE_CACHE).join(&key);
        let tarball = dir.join("base.tar");
        if !tarball.exists() {
            let mmdebstrap = host_tool("mmdebstrap");
            std::fs::create_dir_all(&dir).expect("create the base image cache");
            let partial = dir.join("base.partial.tar");
            eprintln!(
                "bootstrapping {BASE_IMAGE} into {} (about a minute)",
                tarball.display()
            );
            let output = Command::new(&mmdebstrap)
                .args(["--variant=minbase", "--format=tar", "bookworm"])
                .arg(&partial)
                .args(BASE_SOURCES)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("run {}: {e}", mmdebstrap.display()));
            assert!(
                output.status.success(),
                "mmdebstrap failed ({}); it needs Debian's mirror:\n{}",
                output.status,
                output_text(&output)
            );
            std::fs::rename(&partial, &tarball).expect("move the bootstrapped base in place");
        }
        let label = format!("LABEL {BASE_LABEL}={key}");
        let mut args = vec!["import"];
        for change in BASE_CHANGES.iter().chain([&label.as_str()]) {
            args.extend(["--change", change]);
        }
        let tarball = tarball.to_str().expect("utf-8 path");
        args.extend([tarball, BASE_IMAGE]);
        self.podman(&args).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Builds `target` of the repository's Dockerfile, the repository as the build context and
    /// the binary as the `prebuilt` context; in docker format, which keeps the HEALTHCHECK.
    fn build_target(&self, target: &str, tag: &str) {
        let prebuilt = format!("prebuilt={}", self.context.display());
        let dockerfile = format!("{REPO}/Dockerfile");
        self.podman(&[
            "build",
            "--isolation=chroot",
            "--pull=never",
            "--format=docker",
            "--layers",
            "--target",
            target,
            "--build-context",
            &prebuilt,
            "--tag",
            tag,
            "--file",
            &dockerfile,
            REPO,
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    }

    fn inspect(&self) -> ImageConfig {
        let text = self
            .podman(&["image", "inspect", &self.tag])
            .unwrap_or_else(|e| panic!("{e}"));
        let all: Value = serde_json::from_str(&text).expect("podman image inspect prints JSON");
        let image = &all[0];
        let config = &image["Config"];
        let strings = |value: &Value| -> Vec<String> {
            value
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        ImageConfig {
            user: config["User"].as_str().unwrap_or_default().to_string(),
            env: strings(&config["Env"])
                .into_iter()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((&kv, ""));
                    (k.to_string(), v.to_string())
                })
                .collect(),
            entrypoint: strings(&config["Entrypoint"]),
            cmd: strings(&config["Cmd"]),
            stop_signal: config["StopSignal"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            healthcheck: strings(&image["Healthcheck"]["Test"]),
            healthcheck_timeout: Duration::from_nanos(
                image["Healthcheck"]["Timeout"]
                    .as_u64()
                    .unwrap_or(30_000_000_000),
            ),
        }
    }

    /// A path of the image's root filesystem.
    fn path(&self, inside: &str) -> PathBuf {
        self.root.join(inside.trim_start_matches('/'))
    }

    fn env(&self, key: &str) -> String {
        self.config
            .env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("the image sets no {key}: {:?}", self.config.env))
    }

    /// The uid and gid of the image's USER, names looked up in the image's own /etc/passwd and
    /// /etc/group as a container runtime does; root when it sets none.
    fn user_ids(&self) -> (u32, u32) {
        let user = self.config.user.as_str();
        if user.is_empty() {
            return (0, 0);
        }
        let (name, group) = user
            .split_once(':')
            .map_or((user, None), |(u, g)| (u, Some(g)));
        // (id, primary group) of the entry of `file` named `name`, or numbered `name`.
        let lookup = |file: &str, name: &str| -> Option<(u32, Option<u32>)> {
            let text = std::fs::read_to_string(self.path(file)).unwrap_or_default();
            let entry = text.lines().find_map(|line| {
                let fields: Vec<&str> = line.split(':').collect();
                let id: u32 = fields.get(2)?.parse().ok()?;
                (fields[0] == name || id.to_string() == name)
                    .then(|| (id, fields.get(3).and_then(|g| g.parse().ok())))
            });
            entry.or_else(|| name.parse().ok().map(|id| (id, None)))
        };
        let (uid, primary) = lookup("/etc/passwd", name)
            .unwrap_or_else(|| panic!("the image's USER {user} is not in its /etc/passwd"));
        let gid = match group {
            Some(group) => {
                lookup("/etc/group", group)
                    .unwrap_or_else(|| panic!("the image's group {group} is not in its /etc/group"))
                    .0
            }
            None => primary.unwrap_or(0),
        };
        (uid, gid)
    }

    /// ENTRYPOINT followed by CMD: what `docker run IMAGE` runs.
    fn serve_command(&self) -> Vec<String> {
        assert_eq!(
            self.config.cmd.first().map(String::as_str),
            Some("serve"),
            "the image's CMD serves: {:?}",
            self.config.cmd
        );
        self.config
            .entrypoint
            .iter()
            .chain(&self.config.cmd)
            .cloned()
            .collect()
    }

    /// `config check` or `config show` with the arguments of the CMD's `serve`: the
    /// configuration `serve` would run with (src/cli/config.rs).
    fn config_command(&self, action: &str) -> Vec<String> {
        let serve = self.serve_command();
        let at = self.config.entrypoint.len();
        let mut argv = serve[..at].to_vec();
        argv.extend(["config".to_string(), action.to_string()]);
        argv.extend_from_slice(&serve[at + 1..]);
        argv
    }

    /// The file the CMD's `--config` names.
    fn config_file(&self) -> String {
        let cmd = &self.config.cmd;
        cmd.iter()
            .position(|a| a == "--config")
            .and_then(|i| cmd.get(i + 1))
            .cloned()
            .unwrap_or_else(|| panic!("the image's CMD names no --config: {cmd:?}"))
    }

    /// `argv` run from the image's root as its user (no supplementary groups, as in a
    /// container), with exactly the image's environment plus `env`, which replaces a variable of
    /// the same name.
    fn command(&self, argv: &[String], env: &[(&str, &str)]) -> Command {
        let (uid, gid) = self.user_ids();
        let mut cmd = Command::new(host_tool("chroot"));
        cmd.arg(format!("--userspec={uid}:{gid}"))
            .arg(format!("--groups={gid}"))
            .arg(&self.root)
            .args(argv);
        self.set_env(&mut cmd, env);
        cmd
    }

    fn set_env(&self, cmd: &mut Command, env: &[(&str, &str)]) {
        cmd.env_clear();
        for (key, value) in &self.config.env {
            if !env.iter().any(|(k, _)| k == key) {
                cmd.env(key, value);
            }
        }
        cmd.envs(env.iter().copied());
    }

    /// [`Image::command`] in a network namespace of its own, with only loopback, up.
    fn command_private_net(&self, argv: &[String], env: &[(&str, &str)]) -> Command {
        self.wrapped(
            self.command(argv, env),
            env,
            [
                host_tool("unshare").into_os_string(),
                "--net".into(),
                "--".into(),
                "/bin/sh".into(),
                "-c".into(),
                format!(
                    "{} link set lo up && exec \"$@\"",
                    host_tool("ip").display()
                )
                .into(),
                "sh".into(),
            ],
        )
    }

    /// `inner` run by the command `outer`, with the same environment.
    fn wrapped<const N: usize>(
        &self,
        inner: Command,
        env: &[(&str, &str)],
        outer: [std::ffi::OsString; N],
    ) -> Command {
        let mut cmd = Command::new(&outer[0]);
        cmd.args(&outer[1..])
            .arg(inner.get_program())
            .args(inner.get_args());
        self.set_env(&mut cmd, env);
        cmd
    }

    async fn run(&self, argv: &[String], env: &[(&str, &str)]) -> Output {
        run_to_end(self.command(argv, env), WAIT).await
    }

    async fn run_private_net(&self, argv: &[String], env: &[(&str, &str)]) -> Output {
        run_to_end(self.command_private_net(argv, env), WAIT).await
    }

    fn spawn(&self, argv: &[String], env: &[(&str, &str)], name: &str) -> InImage {
        InImage::spawn(self.command(argv, env), name)
    }

    fn spawn_private_net(&self, argv: &[String], env: &[(&str, &str)], name: &str) -> InImage {
        InImage::spawn(self.command_private_net(argv, env), name)
    }

    /// Runs the HEALTHCHECK as a container runtime does (`CMD-SHELL` through `/bin/sh -c`), as
    /// the image's user with its environment, in the network namespace of process `pid`, or in
    /// a fresh one where nothing listens; within the HEALTHCHECK's own timeout.
    async fn healthcheck(&self, pid: Option<u32>) -> Output {
        let test = &self.config.healthcheck;
        let argv: Vec<String> = match test.first().map(String::as_str) {
            Some("CMD-SHELL") if test.len() == 2 => {
                vec!["/bin/sh".into(), "-c".into(), test[1].clone()]
            }
            Some("CMD") => test[1..].to_vec(),
            _ => panic!("the image has no HEALTHCHECK command: {test:?}"),
        };
        let cmd = match pid {
            Some(pid) => self.wrapped(
                self.command(&argv, &[]),
                &[],
                [
                    host_tool("nsenter").into_os_string(),
                    format!("--net=/proc/{pid}/ns/net").into(),
                    "--".into(),
                ],
            ),
            None => self.command_private_net(&argv, &[]),
        };
        run_to_end(cmd, self.config.healthcheck_timeout).await
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        if !self.root.as_os_str().is_empty() {
            if let Err(e) = self.podman(&["image", "unmount", &self.tag]) {
                eprintln!("{e}");
            }
        }
        if self.id_of(&self.tag).is_some() {
            if let Err(e) = self.podman(&["rmi", &self.tag]) {
                eprintln!("{e}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.context);
    }
}

/// A process started from the image; killed and reaped on drop, its output shown if the test
/// failed.
struct InImage {
    child: Child,
    name: String,
    log_path: PathBuf,
    exit: Option<ExitStatus>,
}

impl InImage {
    fn spawn(mut cmd: Command, name: &str) -> InImage {
        let log_path = support::unique_temp_dir("container-log").join("output.log");
        let log = File::create(&log_path).expect("create the log file");
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log file handle"))
            .stderr(log);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
        InImage {
            child,
            name: name.to_string(),
            log_path,
            exit: None,
        }
    }

    /// The process's pid: every wrapper (unshare, sh, chroot) execs the next.
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait");
        }
        self.exit
    }

    async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            if self.try_exit().is_some() || Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Waits until `/healthz` on `addr` answers 200; the log if the process exits first or it
    /// does not answer in time.
    async fn wait_ready(&mut self, addr: SocketAddr) -> Result<(), String> {
        let deadline = Instant::now() + WAIT;
        loop {
            if self.try_exit().is_some() {
                return Err(self.log());
            }
            let probe =
                http::try_request(addr, "GET", "/healthz", &[], None, Duration::from_secs(1)).await;
            if matches!(probe, Ok(ref r) if r.status == 200) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("no answer on {addr} ({probe:?}):\n{}", self.log()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `signal` (a name such as SIGTERM, or a number, as STOPSIGNAL takes it) with kill(1).
    fn signal(&mut self, signal: &str) {
        assert!(self.try_exit().is_none(), "{} already exited", self.name);
        let signal = signal.strip_prefix("SIG").unwrap_or(signal);
        let status = Command::new("kill")
            .args(["-s", signal, &self.pid().to_string()])
            .status()
            .expect("run kill(1)");
        assert!(
            status.success(),
            "kill -s {signal} {}: {status}",
            self.pid()
        );
    }
}

impl Drop for InImage {
    fn drop(&mut self) {
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            self.exit = self.child.wait().ok();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- {} from the image ({:?}) ---\n{}\n--- end of {} ---",
                self.name,
                self.exit,
                self.log(),
                self.name
            );
        }
        if let Some(dir) = self.log_path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Runs `cmd` to its end, killed after `timeout`.
async fn run_to_end(cmd: Command, timeout: Duration) -> Output {
    let program = cmd.get_program().to_os_string();
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program:?}: {e}"));
    tokio::time::timeout(timeout, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{program:?} still running after {timeout:?}"))
        .expect("wait for the command")
}

fn output_text(output: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The uid and gid the pod runs as (deploy/k8s/deployment.yaml: runAsUser, runAsGroup), which
/// the image's USER must give.
fn deployment_user() -> (u32, u32) {
    let deployment = Yaml::read("deploy/k8s/deployment.yaml");
    let id = |key: &str| {
        deployment
            .value(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("deployment.yaml sets no numeric {key}"))
    };
    (id("runAsUser"), id("runAsGroup"))
}

/// ((real uid, effective uid), (real gid, effective gid)) of process `pid`.
fn process_ids(pid: u32) -> ((u32, u32), (u32, u32)) {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let ids = |key: &str| {
        let values: Vec<u32> = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {path}"))
            .split_whitespace()
            .map(|v| v.parse().expect("a numeric id"))
            .collect();
        (values[0], values[1])
    };
    (ids("Uid:"), ids("Gid:"))
}

/// The image tests chroot and mount images: root only. Failing, not skipping, keeps a run that
/// could not check the image from passing.
fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the container tests build and mount images with podman and chroot into them: run them \
         as root"
    );
}

/// The absolute path of a host tool, or a failure that says which package provides it.
fn host_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            let package = match name {
                "ip" => "iproute2",
                "unshare" | "nsenter" => "util-linux",
                "chroot" => "coreutils",
                other => other,
            };
            panic!(
                "{name} not found: the container tests need it (Debian package {package}; \
                 scripts/test installs it)"
            )
        })
}

/// An exclusive lock on `path`, held until the file is dropped.
fn lock_file(path: &Path) -> File {
    std::fs::create_dir_all(path.parent().unwrap()).expect("create the lock's directory");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    // SAFETY: flock on a descriptor this function owns.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(locked, 0, "lock {}", path.display());
    file
}

// ---- the Dockerfile ---------------------------------------------------------------------------

/// One instruction, continuation lines joined and comments dropped.
#[derive(Debug)]
struct Instruction {
    /// First line, counted from 1.
    line: usize,
    /// `AS` name of the stage, or its index.
    stage: String,
    /// WORKDIR in effect.
    workdir: PathBuf,
    keyword: String,
    args: String,
}

/// A COPY or ADD.
#[derive(Debug)]
struct CopySpec {
    from: Option<String>,
    sources: Vec<String>,
    dest: String,
}

impl Instruction {
    fn copy(&self) -> Option<CopySpec> {
        if self.keyword != "COPY" && self.keyword != "ADD" {
            return None;
        }
        let mut words: Vec<String> = Vec::new();
        let mut from = None;
        let mut rest = self.args.trim();
        while let Some(flag) = rest.strip_prefix("--") {
            let (flag, after) = flag.split_once(char::is_whitespace).unwrap_or((flag, ""));
            if let Some(stage) = flag.strip_prefix("from=") {
                from = Some(stage.to_string());
            }
            rest = after.trim_start();
        }
        if rest.starts_with('[') {
            words = serde_json::from_str(rest)
                .unwrap_or_else(|e| panic!("line {}: bad JSON form ({e})", self.line));
        } else {
            words.extend(rest.split_whitespace().map(String::from));
        }
        let dest = words.pop().expect("COPY without a destination");
        Some(CopySpec {
            from,
            sources: words,
            dest,
        })
    }
}

impl CopySpec {
    /// Where the context's `path` ends up in the image, relative destinations taken from
    /// `workdir`; `None` if this COPY does not copy it.
    fn lands_at(&self, path: &str, workdir: &Path) -> Option<PathBuf> {
        let path = normalize(Path::new(path));
        let dest = workdir.join(&self.dest);
        let into_dir = self.dest.ends_with('/') || self.sources.len() > 1;
        self.sources.iter().find_map(|source| {
            let source = normalize(Path::new(source));
            if source == path {
                let name = path.file_name()?;
                Some(normalize(&if into_dir {
                    dest.join(name)
                } else {
                    dest.clone()
                }))
            } else {
                // A directory's contents are copied into the destination.
                let inside = path.strip_prefix(&source).ok()?;
                Some(normalize(&dest.join(inside)))
            }
        })
    }
}

#[derive(Debug)]
struct Dockerfile {
    instructions: Vec<Instruction>,
}

/// What the runtime image declares, from the Dockerfile's text (the file checks need no podman).
#[derive(Debug)]
struct RuntimeSettings {
    exposed: Vec<u16>,
    listen_port: u16,
    healthcheck_port: u16,
    healthcheck_path: String,
    uid: u32,
    gid: u32,
    stop_signal: String,
}

impl Dockerfile {
    fn read() -> Dockerfile {
        let text = std::fs::read_to_string(Path::new(REPO).join("Dockerfile")).expect("Dockerfile");
        let mut instructions = Vec::new();
        let mut stage = String::new();
        let mut stages = 0;
        let mut workdir = PathBuf::from("/");
        let mut pending: Option<(usize, String)> = None;
        for (index, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.starts_with('#') || (pending.is_none() && line.is_empty()) {
                continue;
            }
            let (start, mut joined) = pending.take().unwrap_or((index + 1, String::new()));
            let (body, continues) = match line.strip_suffix('\\') {
                Some(body) => (body.trim(), true),
                None => (line, false),
            };
            if !joined.is_empty() && !body.is_empty() {
                joined.push(' ');
            }
            joined.push_str(body);
            if continues {
                pending = Some((start, joined));
                continue;
            }
            let (keyword, args) = joined
                .split_once(char::is_whitespace)
                .unwrap_or((&joined, ""));
            let keyword = keyword.to_ascii_uppercase();
            let args = args.trim().to_string();
            match keyword.as_str() {
                "FROM" => {
                    let words: Vec<&str> = args.split_whitespace().collect();
                    stage = match words.as_slice() {
                        [_, r#as, name, ..] if r#as.eq_ignore_ascii_case("as") => name.to_string(),
                        _ => stages.to_string(),
                    };
                    stages += 1;
                    workdir = PathBuf::from("/");
                }
                "WORKDIR" => workdir = workdir.join(&args),
                _ => {}
            }
            instructions.push(Instruction {
                line: start,
                stage: stage.clone(),
                workdir: workdir.clone(),
                keyword,
                args,
            });
        }
        Dockerfile { instructions }
    }

    /// The instructions of stage `name`.
    fn stage(&self, name: &str) -> Vec<&Instruction> {
        self.instructions
            .iter()
            .filter(|i| i.stage == name)
            .collect()
    }

    /// The stage the default target (the last stage) copies its binary from.
    fn build_stage(&self) -> Vec<&Instruction> {
        let last = &self.instructions.last().expect("an empty Dockerfile").stage;
        let from = self
            .stage(last)
            .iter()
            .find_map(|i| i.copy().and_then(|c| c.from))
            .expect("the default target copies the binary from a build stage");
        self.stage(&from)
    }

    /// The default target's settings, following its FROM chain through earlier stages.
    fn runtime_settings(&self) -> RuntimeSettings {
        let mut chain = Vec::new();
        let mut stage = self
            .instructions
            .last()
            .expect("an empty Dockerfile")
            .stage
            .clone();
        loop {
            let instructions = self.stage(&stage);
            let base = instructions[0]
                .args
                .split_whitespace()
                .next()
                .unwrap()
                .to_string();
            chain.splice(0..0, instructions);
            if self.instructions.iter().any(|i| i.stage == base) {
                stage = base;
            } else {
                break;
            }
        }
        let last = |keyword: &str| {
            chain
                .iter()
                .rev()
                .find(|i| i.keyword == keyword)
                .map(|i| i.args.clone())
                .unwrap_or_else(|| panic!("the runtime image has no {keyword}"))
        };
        let exposed = chain
            .iter()
            .filter(|i| i.keyword == "EXPOSE")
            .flat_map(|i| i.args.split_whitespace())
            .map(|p| p.trim_end_matches("/tcp").parse().expect("an EXPOSEd port"))
            .collect();
        let listen = chain
            .iter()
            .rev()
            .filter(|i| i.keyword == "ENV")
            .find_map(|i| i.args.strip_prefix("POSTHORN_SERVER__LISTEN="))
            .expect("the runtime image sets POSTHORN_SERVER__LISTEN");
        let healthcheck = last("HEALTHCHECK");
        let url = healthcheck
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in the HEALTHCHECK {healthcheck}"));
        let (authority, path) = url["http://".len()..]
            .split_once('/')
            .expect("a path in the HEALTHCHECK URL");
        let port = |address: &str| -> u16 {
            address
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or_else(|| panic!("no port in {address}"))
        };
        let user = last("USER");
        let (uid, gid) = user.split_once(':').unwrap_or((&user, &user));
        RuntimeSettings {
            exposed,
            listen_port: port(listen),
            healthcheck_port: port(authority),
            healthcheck_path: format!("/{path}"),
            uid: uid.parse().expect("a numeric USER"),
            gid: gid.parse().expect("a numeric USER group"),
            stop_signal: last("STOPSIGNAL"),
        }
    }
}

/// .dockerignore's patterns: `*` and `?` within one path component, a trailing `/`, `!` to
/// take an exclusion back; the last matching line wins, as in Docker.
struct DockerIgnore(Vec<String>);

impl DockerIgnore {
    fn read() -> DockerIgnore {
        let text =
            std::fs::read_to_string(Path::new(REPO).join(".dockerignore")).unwrap_or_default();
        DockerIgnore(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect(),
        )
    }

    /// The pattern that leaves `path` (or a directory above it) out of the context.
    fn excludes(&self, path: &Path) -> Option<String> {
        let components: Vec<String> = path
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let mut verdict = None;
        for pattern in &self.0 {
            let (negated, body) = match pattern.strip_prefix('!') {
                Some(body) => (true, body),
                None => (false, pattern.as_str()),
            };
            let parts: Vec<&str> = body
                .trim_start_matches('/')
                .trim_end_matches('/')
                .split('/')
                .collect();
            let matches = parts.len() <= components.len()
                && parts
                    .iter()
                    .zip(&components)
                    .all(|(p, c)| glob_match(p.as_bytes(), c.as_bytes()));
            if matches {
                verdict = (!negated).then(|| pattern.clone());
            }
        }
        verdict
    }
}

fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    match (pattern.first(), text.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob_match(&pattern[1..], text) || (!text.is_empty() && glob_match(pattern, &text[1..]))
        }
        (Some(b'?'), Some(_)) => glob_match(&pattern[1..], &text[1..]),
        (Some(p), Some(t)) if p == t => glob_match(&pattern[1..], &text[1..]),
        _ => false,
    }
}

/// The words of a shell command, redirections split off (`> src/main.rs` gives `src/main.rs`).
fn shell_words(command: &str) -> Vec<String> {
    command
        .split(|c: char| c.is_whitespace() || c == '>' || c == '<' || c == ';')
        .map(|w| w.trim_matches(|c| c == '\'' || c == '"'))
        .filter(|w| !w.is_empty())
        .map(String::from)
        .collect()
}

/// `path` without `.` components and with `..` applied, lexically.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// `file` in the member directory `dir` ("" for the repository root), as a relative path.
fn join(dir: &str, file: &str) -> String {
    normalize(&Path::new(dir).join(file))
        .to_string_lossy()
        .into_owned()
}

// ---- the manifests ----------------------------------------------------------------------------

fn read_manifest(path: &str) -> toml::Table {
    let full = Path::new(REPO).join(path);
    std::fs::read_to_string(&full)
        .unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
        .parse()
        .unwrap_or_else(|e| panic!("parse {}: {e}", full.display()))
}

/// `[workspace] members`, relative to the repository ("" for the root package).
fn workspace_members(root: &toml::Table) -> Vec<String> {
    root["workspace"]["members"]
        .as_array()
        .expect("[workspace] members in Cargo.toml")
        .iter()
        .map(|m| {
            let m = m.as_str().expect("a member path");
            assert!(
                !m.contains(['*', '?']),
                "member pattern {m}: this check reads literal member paths only"
            );
            join("", m)
        })
        .collect()
}

/// The files of `member`'s targets that cargo needs to read the manifest (explicit targets) or
/// to have anything to build (src/lib.rs, src/main.rs), relative to the member.
fn member_targets(member: &str, manifest: &toml::Table) -> Vec<String> {
    let exists = |file: &str| Path::new(REPO).join(join(member, file)).is_file();
    let mut targets = Vec::new();
    let lib = manifest
        .get("lib")
        .and_then(|l| l.get("path"))
        .and_then(|p| p.as_str());
    match lib {
        Some(path) => targets.push(path.to_string()),
        None if exists("src/lib.rs") => targets.push("src/lib.rs".to_string()),
        None => {}
    }
    if exists("src/main.rs") {
        targets.push("src/main.rs".to_string());
    }
    let package = manifest
        .get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .unwrap_or_default();
    for (kind, dir) in [
        ("bin", "src/bin"),
        ("bench", "benches"),
        ("test", "tests"),
        ("example", "examples"),
    ] {
        let Some(entries) = manifest.get(kind).and_then(|e| e.as_array()) else {
            continue;
        };
        for entry in entries {
            let name = entry
                .get("name")
                .and_then(|n| n.as_str())
                .unwrap_or_default();
            let path = match entry.get("path").and_then(|p| p.as_str()) {
                Some(path) => path.to_string(),
                None if kind == "bin" && name == package => "src/main.rs".to_string(),
                None => format!("{dir}/{name}.rs"),
            };
            if !targets.contains(&path) {
                targets.push(path);
            }
        }
    }
    targets
}

/// `member`'s build script, relative to the repository, if it has one.
fn manifest_build_script(member: &str, manifest: &toml::Table) -> Option<String> {
    match manifest.get("package").and_then(|p| p.get("build")) {
        Some(toml::Value::String(path)) => Some(join(member, path)),
        Some(toml::Value::Boolean(false)) => None,
        _ => Some(join(member, "build.rs")).filter(|script| Path::new(REPO).join(script).is_file()),
    }
}

/// The directories of `member`'s path dependencies (every dependency table, target-specific
/// ones too), relative to the repository.
fn path_dependencies(member: &str, manifest: &toml::Table) -> Vec<String> {
    let tables = ["dependencies", "dev-dependencies", "build-dependencies"];
    let mut found = Vec::new();
    let mut scan = |table: &toml::Table| {
        for kind in tables {
            if let Some(deps) = table.get(kind).and_then(|d| d.as_table()) {
                for dep in deps.values() {
                    if let Some(path) = dep.get("path").and_then(|p| p.as_str()) {
                        found.push(join(member, path));
                    }
                }
            }
        }
    };
    scan(manifest);
    if let Some(targets) = manifest.get("target").and_then(|t| t.as_table()) {
        for target in targets.values().filter_map(|t| t.as_table()) {
            scan(target);
        }
    }
    found.sort();
    found.dedup();
    found
}

/// The directories of the root manifest's `[patch]` entries that are paths.
fn patch_paths(root: &toml::Table) -> Vec<String> {
    root.get("patch")
        .and_then(|p| p.as_table())
        .into_iter()
        .flat_map(|registries| registries.values())
        .filter_map(|crates| crates.as_table())
        .flat_map(|crates| crates.values())
        .filter_map(|entry| entry.get("path").and_then(|p| p.as_str()))
        .map(|path| join("", path))
        .collect()
}

/// config/posthorn.toml: the defaults the image ships.
fn read_config_defaults() -> toml::Table {
    read_manifest("config/posthorn.toml")
}

/// A duration as the configuration writes it: a whole number and ms, s, m, h or d.
fn parse_duration(text: &str) -> Duration {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .unwrap_or_else(|_| panic!("duration {text:?}"));
    match unit {
        "ms" => Duration::from_millis(number),
        "s" | "" => Duration::from_secs(number),
        "m" => Duration::from_secs(number * 60),
        "h" => Duration::from_secs(number * 3600),
        "d" => Duration::from_secs(number * 86_400),
        _ => panic!("duration {text:?}: unknown unit"),
    }
}

// ---- the Kubernetes manifests -----------------------------------------------------------------

/// The lines of a YAML manifest that hold something, comments dropped, with their indentation:
/// enough for the few keys these checks read (there is no YAML parser in the dependency tree).
struct Yaml {
    lines: Vec<(usize, String)>,
}

/// An `httpGet` probe.
#[derive(Debug)]
struct Probe {
    path: String,
    port: String,
    period: u32,
    failure_threshold: u32,
}

impl Yaml {
    fn read(path: &str) -> Yaml {
        let text = std::fs::read_to_string(Path::new(REPO).join(path))
            .unwrap_or_else(|e| panic!("read {path}: {e}"));
        let lines = text
            .lines()
            .filter_map(|line| {
                let content = match line.find(" #") {
                    Some(at) => &line[..at],
                    None => line,
                };
                let trimmed = content.trim_start();
                if trimmed.is_empty() || trimmed.starts_with('#') || trimmed == "---" {
                    return None;
                }
                Some((
                    content.len() - trimmed.len(),
                    trimmed.trim_end().to_string(),
                ))
            })
            .collect();
        Yaml { lines }
    }

    /// The value of `key: value` on line `line`, list dash and quotes dropped.
    fn value_at(&self, line: usize, key: &str) -> Option<String> {
        let content = self.lines[line].1.trim_start_matches("- ");
        let value = content.strip_prefix(key)?.strip_prefix(':')?.trim();
        Some(value.trim_matches('"').trim_matches('\'').to_string())
    }

    /// Every value of `key`, in order.
    fn values(&self, key: &str) -> Vec<String> {
        (0..self.lines.len())
            .filter_map(|i| self.value_at(i, key))
            .collect()
    }

    fn value(&self, key: &str) -> Option<String> {
        self.values(key).into_iter().next()
    }

    /// The lines indented under line `line`.
    fn block(&self, line: usize) -> std::ops::Range<usize> {
        let indent = self.lines[line].0;
        let end = (line + 1..self.lines.len())
            .find(|&i| self.lines[i].0 <= indent)
            .unwrap_or(self.lines.len());
        line + 1..end
    }

    /// The first value of `key` under line `line`.
    fn value_under(&self, line: usize, key: &str) -> Option<String> {
        self.block(line).find_map(|i| self.value_at(i, key))
    }

    /// The container's port: (name, number).
    fn container_port(&self) -> (String, u16) {
        let at = (0..self.lines.len())
            .find(|&i| self.value_at(i, "containerPort").is_some())
            .expect("a containerPort");
        let port = self.value_at(at, "containerPort").unwrap();
        // `- name: http` comes before or after containerPort in the same list item.
        let item = (0..=at)
            .rev()
            .find(|&i| self.lines[i].1.starts_with("- "))
            .unwrap();
        let name = (item..self.block(item).end.max(at + 1))
            .find_map(|i| self.value_at(i, "name"))
            .unwrap_or_default();
        (name, port.parse().expect("a numeric containerPort"))
    }

    /// The `env:` entries: name to literal value (those from a Secret are left out).
    fn env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for i in 0..self.lines.len() {
            if self.lines[i].1 != "env:" {
                continue;
            }
            let block = self.block(i);
            for j in block.clone() {
                if !self.lines[j].1.starts_with("- name:") {
                    continue;
                }
                let name = self.value_at(j, "name").unwrap();
                let value = (j + 1..block.end)
                    .take_while(|&k| !self.lines[k].1.starts_with("- "))
                    .find_map(|k| self.value_at(k, "value"));
                if let Some(value) = value {
                    env.insert(name, value);
                }
            }
        }
        env
    }

    /// The `httpGet` probes by name (readinessProbe, livenessProbe, startupProbe).
    fn probes(&self) -> BTreeMap<String, Probe> {
        let mut probes = BTreeMap::new();
        for i in 0..self.lines.len() {
            let Some(name) = self.lines[i].1.strip_suffix(':') else {
                continue;
            };
            if !name.ends_with("Probe") {
                continue;
            }
            let Some(path) = self.value_under(i, "path") else {
                continue;
            };
            let number = |key: &str, default: u32| {
                self.value_under(i, key)
                    .map_or(default, |v| v.parse().expect("a number"))
            };
            probes.insert(
                name.to_string(),
                Probe {
                    path,
                    port: self.value_under(i, "port").expect("a probe port"),
                    // Kubernetes' defaults.
                    period: number("periodSeconds", 10),
                    failure_threshold: number("failureThreshold", 3),
                },
            );
        }
        probes
    }
}

impl Probe {
    fn unready_after(&self) -> Duration {
        Duration::from_secs(u64::from(self.period * self.failure_threshold))
    }
}
