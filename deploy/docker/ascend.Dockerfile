# moss-npu speech server, Ascend NPU, on the CANN base image (torch, torch_npu and CANN must match: pick the
# torch version your torch_npu release names).
#   docker build -f deploy/docker/ascend.Dockerfile --build-arg TORCH=2.1.0 --build-arg TORCH_NPU=2.1.0.post10 -t moss-npu:npu .
#   docker run --device /dev/davinci0 --device /dev/davinci_manager --device /dev/devmm_svm --device /dev/hisi_hdc \
#     -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro -v /srv/models:/models:ro -v /srv/voices:/voices \
#     -e MOSS_NPU_API_KEY=KEY -p 8000:8000 moss-npu:npu
# Not built or tested here: these machines have the docker client but no daemon, and no registry is reachable
# (docs/scaling.md).
ARG CANN_IMAGE=ascendai/cann:8.0.0-910b-ubuntu22.04-py3.10
FROM ${CANN_IMAGE}
ARG TORCH=2.1.0
ARG TORCH_NPU=2.1.0.post10
USER root
RUN apt-get update && apt-get install -y --no-install-recommends libsndfile1 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 moss
WORKDIR /src
COPY setup.py README.md ./
COPY moss_npu ./moss_npu
RUN pip install --no-cache-dir "torch==${TORCH}" "torch-npu==${TORCH_NPU}" \
 && pip install --no-cache-dir ".[npu,serve]" && pip install --no-cache-dir --no-deps WeTextProcessing==1.2.0
USER moss
VOLUME ["/models", "/voices"]
EXPOSE 8000
# The CANN environment must be sourced in the process that imports torch_npu.
ENTRYPOINT ["bash", "-c", "source /usr/local/Ascend/ascend-toolkit/set_env.sh && exec moss-npu-serve --model /models/MOSS-TTS-Nano --codec /models/MOSS-Audio-Tokenizer-Nano --voices-dir /voices --host 0.0.0.0 --port 8000 \"$@\"", "--"]
CMD ["--device", "npu:0"]
