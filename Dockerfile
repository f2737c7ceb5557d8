# syntax=docker/dockerfile:1
#
# One image, three binaries: gpuwarden-webhook, gpuwarden-operator, gpuwarden-node-agent in
# /usr/local/bin. The manifests pick the binary with `command:`.
#
#   docker build -t ghcr.io/gpuwarden/gpuwarden:0.1.0 .

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# The registry and target caches survive between builds; the binaries are copied out of
# the cache mount in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
        -p gpuwarden-webhook -p gpuwarden-operator -p gpuwarden-node-agent \
    && mkdir -p /out \
    && cp target/release/gpuwarden-webhook target/release/gpuwarden-operator \
        target/release/gpuwarden-node-agent /out/

# distroless/cc: glibc and libgcc only, no shell. NVML (libnvidia-ml.so.1) is not in the
# image: the NVIDIA container runtime injects the host driver's copy into the node agent,
# which loads it at run time.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
# 65532 is distroless's nonroot user; numeric so runAsNonRoot can verify it.
USER 65532:65532
LABEL org.opencontainers.image.source="https://github.com/gpuwarden/gpuwarden" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.description="gpuwarden: webhook, operator and node agent"
