"""pdserve.shared"""
