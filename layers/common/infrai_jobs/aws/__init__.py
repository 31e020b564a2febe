"""AWS services: secrets from SSM and Secrets Manager, Lambda invokes, the second layer."""
