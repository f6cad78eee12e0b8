# syntax=docker/dockerfile:1
# Nebula API image. Build context: the repository root.
#
#   docker build -t nebula .                   # GPU image (default target `runtime`): CUDA kernels for sm_80/86/89/90/120
#   docker build -t nebula-cpu --target cpu .  # CPU-only image from plain Debian, serves the embedded demo model
#
# The GPU image needs the NVIDIA Container Toolkit on the host and a driver that supports CUDA ${CUDA_VERSION}
# (13.0: driver >= 580); choose another CUDA release with --build-arg CUDA_VERSION=... (the nvidia/cuda tag's
# version). The entry point (deploy/entrypoint.sh) runs `nebula profile detect`, then `nebula serve`.
# compose.yaml and deploy/README.md show how to run it.

ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04
ARG RUST_VERSION=1.95.0
ARG DEBIAN_RELEASE=bookworm

# ---- GPU builder: nvcc on PATH, so kernels/build.rs embeds ahead-of-time fatbins --------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS builder
ARG RUST_VERSION
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's packages: security updates replace versions, so pins would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    CUDA_HOME=/usr/local/cuda \
    PATH=/usr/local/cargo/bin:/usr/local/cuda/bin:${PATH}
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --no-modify-path --profile minimal --default-toolchain "${RUST_VERSION}" \
    && rustc --version && nvcc --version
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY assets ./assets
COPY models ./models
COPY deploy/profiles.toml ./deploy/profiles.toml
COPY engine ./engine
COPY kernels ./kernels
COPY service ./service
COPY tests ./tests
# kernels/build.rs finds nvcc (CUDA_HOME) and embeds one fatbin per kernels/cuda/*.cu; without them the image would
# fall back to NVRTC at run time, so a build that made none fails here.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p nebula-service --bin nebula \
    && fatbins=$(find target/release/build -path '*nebula-kernels-*/out/*.fatbin' | wc -l) \
    && echo "embedded CUDA fatbins: ${fatbins}" && [ "${fatbins}" -gt 0 ] \
    && install -D -m 0755 target/release/nebula /out/nebula

# ---- CPU builder: the official Rust image (Debian), no CUDA toolkit ----------------------------------------------
FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS cpu-builder
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY assets ./assets
COPY models ./models
COPY deploy/profiles.toml ./deploy/profiles.toml
COPY engine ./engine
COPY kernels ./kernels
COPY service ./service
COPY tests ./tests
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p nebula-service --bin nebula \
    && install -D -m 0755 target/release/nebula /out/nebula

# ---- CPU-only image: plain Debian, the embedded demo model (or a mounted GGUF with NEBULA_MODEL) ----------------
FROM debian:${DEBIAN_RELEASE}-slim AS cpu
# Debian's stable packages: security updates replace versions, so pins would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 nebula \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/nebula --shell /usr/sbin/nologin nebula \
    && mkdir -p /var/lib/nebula /models \
    && chown nebula:nebula /var/lib/nebula
COPY --from=cpu-builder /out/nebula /usr/local/bin/nebula
COPY deploy/entrypoint.sh /usr/local/bin/nebula-entrypoint
ENV NEBULA_BACKEND=cpu \
    NEBULA_HOST=0.0.0.0 \
    NEBULA_PORT=8090 \
    NEBULA_PROFILE=/var/lib/nebula/profile.toml
USER 10001:10001
WORKDIR /var/lib/nebula
EXPOSE 8090
HEALTHCHECK --interval=15s --timeout=5s --start-period=2m --retries=3 \
    CMD ["/bin/sh", "-c", "curl -fsS http://127.0.0.1:${NEBULA_PORT}/health || exit 1"]
ENTRYPOINT ["/usr/local/bin/nebula-entrypoint"]

# ---- GPU image (default): CUDA runtime libraries (cuBLAS, NVRTC); the driver comes from the host ---------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
# Ubuntu's packages: security updates replace versions, so pins would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 nebula \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/nebula --shell /usr/sbin/nologin nebula \
    && mkdir -p /var/lib/nebula /models \
    && chown nebula:nebula /var/lib/nebula
COPY --from=builder /out/nebula /usr/local/bin/nebula
COPY deploy/entrypoint.sh /usr/local/bin/nebula-entrypoint
ENV NEBULA_BACKEND=auto \
    NEBULA_HOST=0.0.0.0 \
    NEBULA_PORT=8090 \
    NEBULA_PROFILE=/var/lib/nebula/profile.toml \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/nebula
EXPOSE 8090
# Loading ~94 GiB of weights takes minutes; /health answers 503 until the model is loaded.
HEALTHCHECK --interval=15s --timeout=5s --start-period=15m --retries=3 \
    CMD ["/bin/sh", "-c", "curl -fsS http://127.0.0.1:${NEBULA_PORT}/health || exit 1"]
ENTRYPOINT ["/usr/local/bin/nebula-entrypoint"]
