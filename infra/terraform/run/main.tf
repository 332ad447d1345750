# The per-run root module: one GPU node pool named after the run, torn down when the run ends.
module "pool" {
  source              = "../modules/gpu_node_pool"
  name                = "oolong-run-${var.run_id}"
  region              = var.region
  availability_zone   = var.availability_zone
  instance_type       = var.instance_type
  node_count          = var.node_count
  disk_size_gb        = var.disk_size_gb
  spot                = var.spot
  prefect_api_url     = var.prefect_api_url
  work_pool           = "oolong-run-${var.run_id}"
  control_plane_cidrs = var.control_plane_cidrs
  ssh_allowed_cidrs   = var.ssh_allowed_cidrs
  tags                = { "oolong:run" = tostring(var.run_id) }
}
