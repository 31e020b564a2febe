"""The Infrai queue: its HTTP transport, client, typed answers and checked publishing."""
