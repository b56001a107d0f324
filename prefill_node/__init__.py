"""pdserve.prefill_node"""
