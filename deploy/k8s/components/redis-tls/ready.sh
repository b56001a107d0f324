# Redis readiness over TLS: an authenticated PING (the password goes through the environment, never argv).
REDISCLI_AUTH="$(cat /var/run/secrets/pdserve/redis-password)" redis-cli --tls --cacert /etc/redis-tls/ca.crt \
  -p 6379 ping | grep -q PONG
