output "node_addresses" {
  description = "Public addresses of the nodes, in node order (node 0 is the head)."
  value       = local.efa ? aws_eip.efa[*].public_ip : aws_instance.node[*].public_ip
}

output "private_addresses" {
  description = "Private addresses of the nodes (NCCL, DeepSpeed hostfile)."
  value       = aws_instance.node[*].private_ip
}

output "gpus_per_node" {
  description = "GPUs on each node."
  value       = local.gpus
}

output "ssh_user" {
  description = "Login user on the nodes' image."
  value       = "ubuntu"
}

output "node_ids" {
  description = "Instance ids."
  value       = aws_instance.node[*].id
}

output "security_group_id" {
  description = "The pool's security group."
  value       = aws_security_group.pool.id
}

output "ray_address" {
  description = "The run's Ray cluster as the control plane reaches it (Ray Client on node 0; its private address when peered)."
  value       = "ray://${local.peered ? local.ray_head_ip : (local.efa ? aws_eip.efa[0].public_ip : aws_instance.node[0].public_ip)}:${var.ray_client_port}"
}

output "efa_interfaces" {
  description = "Elastic Fabric Adapters on each node (0: NCCL over TCP); see docs/clusters.md."
  value       = local.efa_count
}
