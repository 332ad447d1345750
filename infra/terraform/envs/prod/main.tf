# prod: a multi-AZ control plane and an on-demand GPU pool (runs add per-run pools).
terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
    }
  }
}

provider "aws" {
  region = var.region
}

module "control_plane" {
  source            = "../../modules/control_plane"
  name              = "oolong-prod"
  region            = var.region
  vpc_id            = var.vpc_id
  subnet_ids        = var.private_subnet_ids
  app_subnet_id     = var.app_subnet_id
  app_instance_type = "m6i.xlarge"
  db_instance_class = "db.r6g.large"
  redis_node_type   = "cache.r6g.large"
  admin_cidrs       = var.admin_cidrs
  tags              = { environment = "prod" }
}

module "gpu_pool" {
  source            = "../../modules/gpu_node_pool"
  name              = "oolong-prod-gpu"
  region            = var.region
  availability_zone = var.availability_zone
  instance_type     = var.gpu_instance_type
  node_count        = var.gpu_node_count
  spot              = false
  prefect_api_url   = var.prefect_api_url
  work_pool         = "oolong-prod"
  # A standing pool serves static runs: the build its nodes install (by hash), the deployment's
  # node key (OOLONG_NODE_KEY, as on the flow's worker) and the Prefect API credential.
  oolong_build            = var.oolong_build
  node_key                = var.node_key
  prefect_api_auth_string = var.prefect_api_auth_string
  control_plane_cidrs     = var.control_plane_cidrs
  tags                    = { environment = "prod" }
}
