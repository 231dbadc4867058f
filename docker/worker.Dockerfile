# The ai-worker image, CPU variant (docker-compose.cpu.yml). Built from the prebuilt release
# binary: `scripts/docker stage` runs `cargo build --release` and stages the binary, exactly the
# shared libraries ldd says it loads from the torch 2.11 wheel (libtorch, and the CUDA libraries
# the wheel's libtorch links even when it runs on the CPU) and the TorchScript models exported by
# scripts/setup, with the configuration and the health check, in .local/docker/stage/worker/, the
# build context (docker-compose.yml names it), laid out as /opt/vramgate. Nothing is downloaded at
# run time. Stage 1 checks the files on the runtime base; the final stage holds them and runs
# unprivileged.
FROM debian:bookworm-slim AS files
LABEL vramgate.image=worker
COPY . /opt/vramgate/
RUN ! LD_LIBRARY_PATH=/opt/vramgate/lib ldd /opt/vramgate/bin/ai-worker | grep 'not found'

FROM debian:bookworm-slim
LABEL vramgate.image=worker
RUN useradd --uid 10001 --user-group --home-dir /opt/vramgate --no-create-home --shell /usr/sbin/nologin vramgate
COPY --from=files /opt/vramgate/ /opt/vramgate/
WORKDIR /opt/vramgate
ENV PATH=/opt/vramgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/opt/vramgate/lib \
    VRAMGATE_WORKER_LISTEN=0.0.0.0:8081 \
    VRAMGATE_WORKER_DEVICE=cpu
USER vramgate
EXPOSE 8081
# Ready once the models are loaded, warmed up and calibrated.
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 CMD ["http-ok", "8081", "/v2/health/ready"]
ENTRYPOINT ["ai-worker", "--config", "/opt/vramgate/config/worker.toml"]
