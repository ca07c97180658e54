# The Stoker image for users with Docker: one `stoker` binary (operator and worker are
# subcommands), non-root, read-only-root friendly, CA certificates for S3 over TLS.
#   docker build -t ghcr.io/stoker-dev/stoker:0.1.0 .
# Without a Docker engine (and in CI): scripts/build-image.sh builds the same layout FROM
# scratch with podman. docs/operator.md says how to push or load it.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends nasm cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --bin stoker && strip target/release/stoker

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/stoker /usr/local/bin/stoker
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/stoker"]
