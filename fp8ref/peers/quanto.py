"""placeholder"""
PEERS = ()
