# Stand-in for the redis image docker-compose.yml names (redis:7.0-bookworm = Debian bookworm's redis 7.0), built
# by docker/base_images.sh only when no registry can be pulled from. Like the official image it runs as the redis
# user in /data and has redis-cli for the healthcheck; protected mode is turned off by the compose command (the
# official build disables it at compile time).
FROM debian:bookworm-slim
ARG STANDIN_HASH
LABEL ragserve.standin="${STANDIN_HASH}"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
