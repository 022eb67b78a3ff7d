# The stockade router: the locked dependencies, bubblewrap for the bwrap tier, the shipped policies.
# Build: docker build -t stockade-router .   (compose.yaml builds it too)
FROM python:3.11-slim-bookworm
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap socat ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/stockade
COPY requirements.lock ./
RUN python -m pip install --no-cache-dir --require-hashes -r requirements.lock
COPY pyproject.toml README.md ./
COPY router ./router
COPY policy ./policy
COPY runner ./runner
COPY policies ./policies
RUN python -m pip install --no-cache-dir --no-deps .
ENV STOCKADE_POLICY__DIR=/opt/stockade/policies \
    STOCKADE_AUDIT__PATH=/var/lib/stockade/audit/audit.jsonl \
    STOCKADE_LOG_FORMAT=json
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=2)"
CMD ["stockade", "serve", "--host", "0.0.0.0", "--port", "8080"]
