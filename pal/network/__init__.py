"""The node's network path: a per-VM namespace with a tap (netns.py), nftables rules that
send every guest TCP connection and DNS query to the egress gateway (nft.py), the gateway
process itself (gateway.py: policy, DNS, relay, counters, events) and the node's handle on
it (control.py). See docs/network.md."""
