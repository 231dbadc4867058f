# A local substitute for the official prom/prometheus image, built by `scripts/docker
# base-images` where no registry is reachable (this project's CI): Debian's own prometheus
# package (2.42.0 in bookworm, hence the image tag) with the official image's entrypoint, default
# command, storage folder and user. wget stands in for the official image's busybox wget, which
# docker-compose.yml's health check calls.
FROM debian:bookworm-slim
RUN set -eux; \
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 0755 /usr/sbin/policy-rc.d; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget; \
    rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d; \
    mkdir -p /prometheus; chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
VOLUME ["/prometheus"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
