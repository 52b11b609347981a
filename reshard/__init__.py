"""reshard"""
