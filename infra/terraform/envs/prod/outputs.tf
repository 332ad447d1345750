output "database_endpoint" {
  description = "PostgreSQL endpoint for DATABASE_URL."
  value       = module.control_plane.database_endpoint
}

output "redis_endpoint" {
  description = "Redis endpoint for CELERY_BROKER_URL."
  value       = module.control_plane.redis_endpoint
}

output "gpu_node_addresses" {
  description = "Addresses of the dev GPU nodes."
  value       = module.gpu_pool.node_addresses
}
