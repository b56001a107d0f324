"""pdserve.decode_node"""
