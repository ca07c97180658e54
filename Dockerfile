# The Stoker image for users with Docker: one `stoker` binary (operator and worker are
# subcommands), non-root, read-only-root friendly, CA certificates for S3 over TLS.
#   docker build -t ghcr.io/stoker-dev/stoker:0.1.0 .
# Without a Docker engine (and in CI): scripts/build-image.sh builds the same layout FROM
# scratch with podman. docs/operator.md says how to push or load it.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends nasm cmake pkg-config clang \
    libclang-dev libavcodec-dev libavformat-dev libavutil-dev libswscale-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --bin stoker && strip target/release/stoker

# FFmpeg's libraries (video) come with the binary: the shared libraries it links, as
# scripts/build-image.sh copies them.
RUN mkdir /libs && ldd target/release/stoker | grep -o '/[^ ]*' | xargs -I{} cp -L --parents {} /libs

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /libs/ /
COPY --from=build /src/target/release/stoker /usr/local/bin/stoker
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/stoker"]
