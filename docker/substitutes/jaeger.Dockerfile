# A local substitute for the official jaegertracing/jaeger image (2.x), built by
# `scripts/docker base-images` where no registry is reachable (this project's CI): the real Jaeger
# binary that scripts/go-tools builds from the Go module proxy (JAEGER_VERSION), at the official
# image's path, user, environment and entrypoint. wget stands in for the official image's
# busybox wget, which docker-compose.yml's health check calls.
FROM debian:bookworm-slim
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget; \
    rm -rf /var/lib/apt/lists/*
COPY jaeger /cmd/jaeger/jaeger-linux
ENV JAEGER_LISTEN_HOST=0.0.0.0
EXPOSE 4317 4318 5778 5779 9411 13133 14250 14268 16686
VOLUME ["/tmp"]
USER 10001
ENTRYPOINT ["/cmd/jaeger/jaeger-linux"]
