# A local substitute for the official rust:<version>-slim-bookworm image, built by `scripts/docker
# base-images` where no registry is reachable (this project's CI): Debian bookworm's slim image,
# what the official slim image installs beside Rust (gcc, libc6-dev, ca-certificates), and the
# host's own toolchain of that version (rustc, cargo, the standard library; no docs), laid out
# and named as the official image lays it out: RUSTUP_HOME=/usr/local/rustup,
# CARGO_HOME=/usr/local/cargo, the commands in /usr/local/cargo/bin.
FROM debian:bookworm-slim
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*
ARG RUST_VERSION
COPY toolchain /usr/local/rustup/toolchains/${RUST_VERSION}-x86_64-unknown-linux-gnu
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUST_VERSION=${RUST_VERSION}
RUN set -eux; \
    mkdir -p "$CARGO_HOME/bin"; \
    for tool in cargo rustc rustdoc; do \
      ln -s "$RUSTUP_HOME/toolchains/${RUST_VERSION}-x86_64-unknown-linux-gnu/bin/$tool" "$CARGO_HOME/bin/$tool"; \
    done; \
    chmod -R a+w "$CARGO_HOME"; \
    cargo --version; rustc --version
