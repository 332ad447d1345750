# The per-run root module: one GPU node pool named after the run, torn down when the run ends.
module "pool" {
  source            = "../modules/gpu_node_pool"
  name              = "oolong-run-${var.run_id}"
  region            = var.region
  availability_zone = var.availability_zone
  instance_type     = var.instance_type
  node_count        = var.node_count
  disk_size_gb      = var.disk_size_gb
  spot              = var.spot
  prefect_api_url   = var.prefect_api_url
  work_pool         = "oolong-run-${var.run_id}"
  # Written by the orchestration, never by a run spec: the exact build (by hash), the run's node
  # key, the Prefect API's credential.
  oolong_build            = var.oolong_build
  node_key                = var.node_key
  prefect_api_auth_string = var.prefect_api_auth_string
  efa                     = var.efa
  control_plane_cidrs     = var.control_plane_cidrs
  prefect_api_port        = local.prefect_api_port
  server_port_range       = var.server_port_range
  checkpoint_bucket       = var.checkpoint_bucket
  checkpoint_prefix       = var.checkpoint_prefix
  checkpoint_run_key      = "run-${var.run_id}"
  ssh_allowed_cidrs       = var.ssh_allowed_cidrs
  # Its own range per run (10.100.0.0/16 .. 10.249.0.0/16): runs peered with the same control
  # plane at once must not overlap there. The spec refuses a control plane inside it:
  # training_core/config.py RUN_VPC_OCTETS, checked equal by tests/infra/test_terraform.py.
  vpc_cidr                      = "10.${100 + var.run_id % 150}.0.0/16"
  control_plane_vpc_id          = var.control_plane_vpc_id
  control_plane_vpc_cidr        = var.control_plane_vpc_cidr
  control_plane_route_table_ids = var.control_plane_route_table_ids
  tags                          = { "oolong:run" = tostring(var.run_id) }
}

locals {
  # The port the nodes' workers reach the Prefect API on (the security group opens it).
  prefect_port_match = regexall("^https?://[^/:]+:([0-9]+)", var.prefect_api_url)
  prefect_api_port   = length(local.prefect_port_match) > 0 ? tonumber(local.prefect_port_match[0][0]) : (startswith(var.prefect_api_url, "https://") ? 443 : 80)
}
