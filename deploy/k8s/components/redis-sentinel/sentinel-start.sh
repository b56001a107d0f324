# A sentinel: monitors the primary the other sentinels name (pdserve-redis-0 at the group's first start),
# quorum 2 of 3, by stable DNS names. Its config file is its own (a sentinel rewrites it) in a memory volume.
set -eu
umask 077
password="$(cat /var/run/secrets/pdserve/redis-password)"
me="$(hostname).pdserve-sentinel"
primary=""
for i in 0 1 2; do
  peer="pdserve-sentinel-$i.pdserve-sentinel"
  [ "$peer" = "$me" ] && continue
  primary="$(redis-cli -h "$peer" -p 26379 --raw sentinel get-master-addr-by-name mymaster 2>/dev/null \
    | head -n 1)" || primary=""
  [ -n "$primary" ] && break
done
[ -n "$primary" ] || primary="pdserve-redis-0.pdserve-redis"
cat > /run/sentinel/sentinel.conf <<CONF
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $me
sentinel monitor mymaster $primary 6379 2
sentinel auth-pass mymaster $password
sentinel down-after-milliseconds mymaster 5000
sentinel failover-timeout mymaster 30000
sentinel parallel-syncs mymaster 1
CONF
exec redis-server /run/sentinel/sentinel.conf --sentinel
