# moss-npu speech server, CPU. Build from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t moss-npu:cpu .
#   docker run -p 8000:8000 -e MOSS_NPU_API_KEY=KEY -v /srv/models:/models:ro -v /srv/voices:/voices moss-npu:cpu
# Not built or tested here: these machines have the docker client but no daemon, and no registry is reachable
# (docs/scaling.md).

# Build stage: the compiler and headers; wheels for the package (its C library compiled in, for every
# instruction set of the architecture: setup.py) and everything it needs.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY setup.py README.md ./
COPY moss_npu ./moss_npu
RUN pip wheel --wheel-dir /wheels --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" ".[serve]" \
 && pip wheel --wheel-dir /wheels --no-deps WeTextProcessing==1.2.0

# Runtime: no compiler; the package's wheel carries its compiled C library.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libsndfile1 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 moss
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels moss-npu[serve] \
 && pip install --no-cache-dir --no-index --no-deps --find-links /wheels WeTextProcessing==1.2.0 && rm -rf /wheels
USER moss
ENV MOSS_NPU_CACHE_DIR=/home/moss/.cache/moss-npu
VOLUME ["/models", "/voices"]
EXPOSE 8000
ENTRYPOINT ["moss-npu-serve", "--model", "/models/MOSS-TTS-Nano", "--codec", "/models/MOSS-Audio-Tokenizer-Nano", \
            "--voices-dir", "/voices", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--device", "cpu"]
