# moss-npu speech server, NVIDIA CUDA (one GPU per container, or one Ray replica per GPU with the ray extra).
#   docker build -f deploy/docker/cuda.Dockerfile -t moss-npu:cuda .
#   docker run --gpus 1 -p 8000:8000 -e MOSS_NPU_API_KEY=KEY -v /srv/models:/models:ro -v /srv/voices:/voices moss-npu:cuda
# Not built or tested here: these machines have the docker client but no daemon, and no registry is reachable
# (docs/scaling.md).
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip build-essential libsndfile1 \
 && rm -rf /var/lib/apt/lists/* && useradd --create-home --uid 10001 moss
WORKDIR /src
COPY setup.py README.md ./
COPY moss_npu ./moss_npu
RUN pip3 install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cu124 \
 && pip3 install --no-cache-dir ".[serve,ray]" && pip3 install --no-cache-dir --no-deps WeTextProcessing==1.2.0
USER moss
VOLUME ["/models", "/voices"]
EXPOSE 8000
ENTRYPOINT ["moss-npu-serve", "--model", "/models/MOSS-TTS-Nano", "--codec", "/models/MOSS-Audio-Tokenizer-Nano", \
            "--voices-dir", "/voices", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--device", "cuda:0"]
