output "database_endpoint" {
  description = "PostgreSQL host:port for DATABASE_URL (the password is in Secrets Manager)."
  value       = aws_db_instance.postgres.endpoint
}

output "database_secret_arn" {
  description = "Secrets Manager secret holding the PostgreSQL master password."
  value       = aws_db_instance.postgres.master_user_secret[0].secret_arn
}

output "redis_endpoint" {
  description = "Redis primary endpoint for CELERY_BROKER_URL (rediss://, TLS)."
  value       = aws_elasticache_replication_group.redis.primary_endpoint_address
}

output "app_private_address" {
  description = "Private address of the application host."
  value       = aws_instance.app.private_ip
}

output "app_security_group_id" {
  description = "Security group of the application host (allow it on the GPU pools' rollout port)."
  value       = aws_security_group.app.id
}

output "prefect_api_auth_string" {
  description = "The Prefect API's basic-auth credential: PREFECT_SERVER_API_AUTH_STRING on the Prefect server, PREFECT_API_AUTH_STRING on its clients (docs/orchestration.md)."
  value       = "oolong:${random_password.prefect_api.result}"
  sensitive   = true
}
