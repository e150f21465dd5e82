"""A ``loraplex-server`` process and its clients: open-loop load, the gRPC and HTTP edges' costs."""
