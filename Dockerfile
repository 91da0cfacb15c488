# posthorn container image.
#
#   docker build -t posthorn .
# compiles the hub (stage `build`) and puts it into the runtime image (the last stage, `runtime`).
# tests/container.rs builds the target `runtime-prebuilt` instead, with podman, around the binary
# the test suite has just compiled, and runs that image's own binary, user, configuration and
# HEALTHCHECK; it also checks that this file copies every workspace member (the `build` stage
# itself is not run by the tests).
#
# Configuration is by environment: every key of config/posthorn.toml can be overridden with
# POSTHORN_<SECTION>__<KEY> (e.g. POSTHORN_SSE__QUEUE_LIMIT=100). See docs/operations.md.

# ---- build ---------------------------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src

# Dependencies first, against placeholder sources, so that editing src/ does not rebuild them.
# vendor/: the patched actix-http (vendor/actix-http/POSTHORN-PATCH.md). The manifest names
# a bench target, so it needs a placeholder too; the image does not build it. client/ is the
# workspace's second member (the reference client crate, which `posthorn tail` uses).
COPY Cargo.toml Cargo.lock ./
COPY client/Cargo.toml ./client/
COPY vendor ./vendor
RUN mkdir src benches client/src \
    && echo 'fn main() {}' > src/main.rs \
    && echo 'fn main() {}' > benches/sse_floor.rs \
    && touch src/lib.rs client/src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src client/src

COPY src ./src
COPY client/src ./client/src
COPY config ./config
# COPY keeps the files' original mtimes, which can be older than the placeholder build:
# touch them so cargo rebuilds the crates themselves.
RUN touch src/main.rs src/lib.rs client/src/lib.rs \
    && cargo build --release --locked \
    && install -m 0755 target/release/posthorn /usr/local/bin/posthorn

# ---- runtime-base: everything of the runtime image but the binary ----------------------------
# Shared by the two ways of getting the binary below, so that the image the tests run is this
# image, not a copy of its settings.
FROM debian:bookworm-slim AS runtime-base

# ca-certificates for TLS backends (rediss://); curl for the HEALTHCHECK below.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin posthorn

COPY config/posthorn.toml /etc/posthorn/posthorn.toml

# Listen on all interfaces inside the container.
#
# SECURE BY DEFAULT: with auth.mode = "none", `posthorn serve` refuses a non-loopback listen
# address and exits with code 64. The operator must choose, at `docker run` time, one of:
#   -e POSTHORN_AUTH__MODE=jwt  with either -e POSTHORN_AUTH__JWT_SECRET=<HS256 secret> or
#      -e POSTHORN_AUTH__JWT_PUBLIC_KEY_FILE=<path of a mounted RS256/ES256 public key PEM>
#      (recommended: streams then need a token whose `sub` is the device, publishing the
#      `publish` scope and /admin/* the `admin` scope)
#   -e POSTHORN_SERVER__INSECURE=true  (only behind a trusted network or an authenticating proxy)
# The image deliberately sets neither. /healthz, /readyz and /metrics need no token, so the
# HEALTHCHECK below works in both modes. `posthorn token` mints HS256 test tokens, e.g.
#   docker run --rm -e POSTHORN_AUTH__JWT_SECRET=... posthorn token --device pos-17
ENV POSTHORN_SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080

USER 10001:10001

# SIGTERM starts the graceful drain (docs/operations.md). Give the container more time than
# drain.grace (30 s by default) before it is killed, e.g. `docker stop -t 40`.
STOPSIGNAL SIGTERM

# /healthz is 200 while the process runs (liveness); /readyz is the readiness probe.
# Assumes the listen port above; change both together.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8080/healthz || exit 1

ENTRYPOINT ["/usr/local/bin/posthorn"]
CMD ["serve", "--config", "/etc/posthorn/posthorn.toml"]

# ---- runtime-prebuilt: the runtime image around a binary compiled outside Docker -------------
# For a binary built on Debian 12 (bookworm's glibc), taken from the build context named
# `prebuilt`, so that the main context stays this repository:
#   docker build --target runtime-prebuilt --build-context prebuilt=target/release -t posthorn .
# A default build never reaches this stage: BuildKit (docker's builder since Docker 23) and
# podman build only what the target needs. The legacy builder (DOCKER_BUILDKIT=0) would build
# it and fail for want of the `prebuilt` context.
FROM runtime-base AS runtime-prebuilt
COPY --from=prebuilt posthorn /usr/local/bin/posthorn

# ---- runtime: the default target, the binary from the build stage --------------------------
FROM runtime-base AS runtime
COPY --from=build /usr/local/bin/posthorn /usr/local/bin/posthorn
