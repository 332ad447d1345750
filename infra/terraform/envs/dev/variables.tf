variable "region" {
  type        = string
  description = "Cloud region."
  default     = "us-east-1"
}

variable "availability_zone" {
  type        = string
  description = "Zone of the GPU nodes."
  default     = "us-east-1a"
}

variable "vpc_id" {
  type        = string
  description = "VPC of the control plane."
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Two private subnets for PostgreSQL and Redis."
}

variable "app_subnet_id" {
  type        = string
  description = "Subnet of the application host."
}

variable "admin_cidrs" {
  type        = list(string)
  description = "Networks allowed to reach the web app."
  default     = []
}

variable "control_plane_cidrs" {
  type        = list(string)
  description = "Control plane networks allowed on the GPU nodes' rollout port."
  default     = []
}

variable "gpu_instance_type" {
  type        = string
  description = "GPU instance type."
  default     = "g5.xlarge"
}

variable "gpu_node_count" {
  type        = number
  description = "Always-on GPU nodes in dev (runs add their own per-run pools)."
  default     = 1
}

variable "prefect_api_url" {
  type        = string
  description = "Prefect server API URL."
}

variable "oolong_build" {
  type = object({
    wheel              = object({ url = string, sha256 = string })
    constraints        = object({ url = string, sha256 = string })
    sglang_constraints = object({ url = string, sha256 = string })
  })
  description = "The build the standing nodes install, each file's URL and sha256: `python -m orchestration.builds --store s3://<bucket>/<prefix>` publishes them and prints this value."
}

variable "node_key" {
  type        = string
  sensitive   = true
  description = "The deployment's node key (OOLONG_NODE_KEY on the flow's worker and every static node)."
}

variable "prefect_api_auth_string" {
  type        = string
  sensitive   = true
  description = "The Prefect API's basic-auth credential (user:password) the nodes' workers present."
}
