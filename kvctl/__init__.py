"""pdserve.kvctl"""
