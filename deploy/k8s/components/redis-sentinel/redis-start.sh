# A Redis pod of the Sentinel group: the replica of the primary the sentinels name, or, when none answers
# (the group's first start), pdserve-redis-0 is the primary and the others its replicas. It announces its
# stable DNS name, so the sentinels hand clients a name that survives the pod's restart.
set -eu
umask 077
password="$(cat /var/run/secrets/pdserve/redis-password)"
me="$(hostname).pdserve-redis"
primary=""
for i in 0 1 2; do
  primary="$(redis-cli -h "pdserve-sentinel-$i.pdserve-sentinel" -p 26379 --raw \
    sentinel get-master-addr-by-name mymaster 2>/dev/null | head -n 1)" || primary=""
  [ -n "$primary" ] && break
done
if [ -z "$primary" ] && [ "$(hostname)" != "pdserve-redis-0" ]; then
  primary="pdserve-redis-0.pdserve-redis"
fi
{
  printf 'requirepass "%s"\nmasterauth "%s"\n' "$password" "$password"
  printf 'replica-announce-ip %s\n' "$me"
  if [ -n "$primary" ] && [ "$primary" != "$me" ]; then
    printf 'replicaof %s 6379\n' "$primary"
  fi
} > /run/redis/auth.conf
exec redis-server /etc/redis/redis.conf
