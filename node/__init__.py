"""The node runtime every role shares: process entry and settings, registration and heartbeat, internal
routes, the prefix fetch between nodes, KV reservations, metrics and the stats line. It may import
`kvtransfer` (the fetch moves KV); `shared/` never imports it. The contracts the router and kvctl share with
the nodes (the node protocol, request signing, the credential check) stay in shared/node/."""
