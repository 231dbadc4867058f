# The api-gateway image; the compose stack's one-shot producer runs it too (vramgate-cli and the
# sample inputs are in it). Built from prebuilt release binaries: `scripts/docker stage` runs
# `cargo build --release` (the binaries the test suite tests) and stages them with the
# configuration, the health check and the samples in .local/docker/stage/gateway/, the build
# context (docker-compose.yml names it), laid out as /opt/vramgate. Stage 1 checks the files on
# the runtime base, the final stage holds them, the base's runtime libraries and nothing else,
# and runs as an unprivileged user.

# The runtime base: Debian's slim image plus what librdkafka's TLS needs at run time, OpenSSL
# (libssl3, linked dynamically) and the public CAs (ca-certificates: a managed Kafka's
# certificate is checked against them unless ssl.ca.location names another CA).
FROM debian:bookworm-slim AS runtime
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libssl3 ca-certificates; \
    rm -rf /var/lib/apt/lists/*

FROM runtime AS files
LABEL vramgate.image=gateway
COPY . /opt/vramgate/
# Every shared library the binaries need must come with the runtime base.
RUN ! ldd /opt/vramgate/bin/api-gateway /opt/vramgate/bin/vramgate-cli | grep 'not found'

FROM runtime
LABEL vramgate.image=gateway
RUN set -eux; \
    useradd --uid 10001 --user-group --home-dir /opt/vramgate --no-create-home --shell /usr/sbin/nologin vramgate; \
    mkdir -p /data/inputs; chown vramgate:vramgate /data/inputs
COPY --from=files /opt/vramgate/ /opt/vramgate/
WORKDIR /opt/vramgate
# Metrics and health listen on all of the container's interfaces; docker-compose.yml publishes
# them on the host's loopback only. Inputs are read from the volume at /data/inputs.
ENV PATH=/opt/vramgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    VRAMGATE_GATEWAY_METRICS_LISTEN=0.0.0.0:9464 \
    VRAMGATE_GATEWAY_INPUT__FILE_ROOT=/data/inputs
USER vramgate
EXPOSE 9464
# Healthy = ready: the broker answers, the topics exist, the workers are ready.
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 CMD ["http-ok", "9464", "/readyz"]
ENTRYPOINT ["api-gateway", "--config", "/opt/vramgate/config/gateway.toml"]
