# One image for every tokenbus service; the command picks which (`tokenbus serve <service>`).
#   docker build --network host -t tokenbus:latest .
# Offline (a local package mirror or a folder of wheels): compose/build-offline.sh passes
# PIP_INDEX_URL, or PIP_NO_INDEX=1 with PIP_FIND_LINKS; pip reads them from the environment.
FROM python:3.11-slim
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY bus_schemas bus_schemas
COPY services services
COPY dialects dialects
COPY jobs jobs
COPY gateway gateway
COPY router router
COPY engine_worker engine_worker
COPY telemetry telemetry
COPY auth auth
COPY filter filter
COPY tokenbus tokenbus
# The versions the tests ran with (constraints.txt, `make lock`), not the newest the open
# ranges of pyproject.toml allow on the day of the build.
RUN pip install --no-cache-dir -c constraints.txt . && rm -rf /app/build
# Not root. Compose and Kubernetes run each role as a uid of its own (10001-10010, see
# services/deploybundle.py), so file permissions keep each role's NATS login to itself.
RUN useradd --uid 10000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tokenbus
USER 10000
ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1 TOKENBUS_NATS_URL=nats://nats:4222
ENTRYPOINT ["tokenbus"]
