"""The data channel between the gateway and pool replicas: one authenticated TCP connection per
(gateway process, replica), many requests multiplexed on it, reply bytes relayed as they are.

Ray Serve keeps owning the replicas (placement, health, scaling, draining); requests and their
streamed replies travel here instead of as Ray calls, so a streamed token costs a frame on a
socket, not a serialised, scheduled remote call. `frames` is the wire format, `server` the
replica's end, `client` the gateway's end, `secret` how both learn the key that admits a gateway.
"""
