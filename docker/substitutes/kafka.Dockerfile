# A local substitute for the official apache/kafka image, built by `scripts/docker base-images`
# where no registry is reachable (this project's CI). It keeps the official image's interface as
# docker-compose.yml uses it: configuration from KAFKA_* variables (KAFKA_LOG_DIRS → log.dirs;
# `__` → `_`, `___` → `-`) and CLUSTER_ID, /opt/kafka/bin/kafka-topics.sh, /var/lib/kafka/data,
# user appuser, CMD /etc/kafka/docker/run. The broker is the real Apache Kafka, from the Maven
# Central jars scripts/broker installs, on Debian's Java 17 runtime.
FROM debian:bookworm-slim

# (The JRE's postinst links its man pages into /usr/share/man/man1, which slim images lack.)
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --create-home --shell /bin/bash --uid 1000 appuser; \
    mkdir -p /opt/kafka/bin /opt/kafka/config /var/lib/kafka/data /etc/kafka/docker; \
    chown appuser:appuser /opt/kafka/config /var/lib/kafka/data

COPY libs/ /opt/kafka/libs/
COPY log4j2.properties tools-log4j2.properties /opt/kafka/config/
COPY run /etc/kafka/docker/run
# The command-line tools compose calls, as Kafka's own bin/*.sh run them: the tool's class.
RUN set -eux; \
    for tool in kafka-topics:org.apache.kafka.tools.TopicCommand \
                kafka-storage:kafka.tools.StorageTool \
                kafka-console-producer:org.apache.kafka.tools.ConsoleProducer; do \
      printf '#!/bin/sh\nexec java ${KAFKA_TOOL_HEAP_OPTS:--Xmx256m} -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties -cp "/opt/kafka/libs/*" %s "$@"\n' \
        "${tool#*:}" >"/opt/kafka/bin/${tool%%:*}.sh"; \
    done; \
    chmod 0755 /opt/kafka/bin/*.sh /etc/kafka/docker/run

USER appuser
EXPOSE 9092
VOLUME ["/var/lib/kafka/data"]
CMD ["/etc/kafka/docker/run"]
