"""What the router, kvctl and the nodes share about a node: the router <-> node protocol (node_protocol.py),
the signing of internal calls and node records (node_sign.py), and the credential check in front of a node's
internal routes (node_auth.py). The node runtime itself is the package `pdserve.node`."""
