# The ai-worker image, CUDA variant (docker-compose.yml's default worker). The same build context as
# docker/worker.Dockerfile (.local/docker/stage/worker/, from `scripts/docker stage`): the binary, the torch 2.11 wheel's libtorch and
# the CUDA 13 user-space libraries it links (cuBLAS, cuDNN, NCCL, ...), and the models. The NVIDIA
# base image adds what the wheel cannot: the container toolkit's hook-up of the host's driver
# (libcuda) through NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES. Needs a GPU host with the
# NVIDIA Container Toolkit; never built or run in this project's CI (no registry, no GPU).
FROM nvidia/cuda:13.0.1-base-ubuntu24.04 AS files
LABEL vramgate.image=worker
COPY . /opt/vramgate/
RUN ! LD_LIBRARY_PATH=/opt/vramgate/lib ldd /opt/vramgate/bin/ai-worker | grep 'not found'

FROM nvidia/cuda:13.0.1-base-ubuntu24.04
LABEL vramgate.image=worker
RUN useradd --uid 10001 --user-group --home-dir /opt/vramgate --no-create-home --shell /usr/sbin/nologin vramgate
COPY --from=files /opt/vramgate/ /opt/vramgate/
WORKDIR /opt/vramgate
ENV PATH=/opt/vramgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/opt/vramgate/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    VRAMGATE_WORKER_LISTEN=0.0.0.0:8081 \
    VRAMGATE_WORKER_DEVICE=cuda
USER vramgate
EXPOSE 8081
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 CMD ["http-ok", "8081", "/v2/health/ready"]
ENTRYPOINT ["ai-worker", "--config", "/opt/vramgate/config/worker.toml"]
