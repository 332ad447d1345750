output "node_addresses" {
  description = "Public node addresses (node 0 is the head)."
  value       = module.pool.node_addresses
}

output "private_addresses" {
  description = "Private node addresses (NCCL, DeepSpeed hostfile)."
  value       = module.pool.private_addresses
}

output "gpus_per_node" {
  description = "GPUs per node."
  value       = module.pool.gpus_per_node
}

output "ssh_user" {
  description = "Login user on the nodes."
  value       = module.pool.ssh_user
}

output "ray_address" {
  description = "The run's Ray cluster (placement of every process on the GPUs), for the training-run flow."
  value       = module.pool.ray_address
}
