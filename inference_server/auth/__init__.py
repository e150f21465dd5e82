"""Tenants: who is calling (tokens), what they may do (policy), and how much (quotas).

Plain Python with no gRPC: the server's interceptor and servicer call into it.
"""
