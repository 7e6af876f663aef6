# One image for every tokenbus service; the command picks which (`tokenbus serve <service>`).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bus_schemas bus_schemas
COPY services services
COPY gateway gateway
COPY router router
COPY engine_worker engine_worker
COPY telemetry telemetry
COPY auth auth
COPY filter filter
COPY tokenbus tokenbus
RUN pip install --no-cache-dir .
ENV TOKENBUS_NATS_URL=nats://nats:4222
ENTRYPOINT ["tokenbus"]
