# A local substitute for the official chrislusf/seaweedfs image, built by
# `scripts/docker base-images` where no registry is reachable (this project's CI): the real weed
# binary that scripts/go-tools builds from the Go module proxy (SEAWEEDFS_VERSION), at the
# official image's path. docker-compose.yml names `weed` as the entrypoint, so the official
# image's entrypoint script is not needed; wget stands in for its busybox wget, which the health
# check calls.
FROM debian:bookworm-slim
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget; \
    rm -rf /var/lib/apt/lists/*
COPY weed /usr/bin/weed
EXPOSE 8333 8888 9333 18080
VOLUME ["/data"]
ENTRYPOINT ["/usr/bin/weed"]
