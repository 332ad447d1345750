variable "name" {
  type        = string
  description = "Name prefix for every resource of this node pool (e.g. oolong-run-42)."
}

variable "region" {
  type        = string
  description = "Cloud region, e.g. us-east-1."
}

variable "availability_zone" {
  type        = string
  description = "Zone for all nodes: NCCL wants them close (one placement group)."
}

variable "instance_type" {
  type        = string
  description = "GPU instance type, e.g. g5.xlarge (1x A10G) or p4d.24xlarge (8x A100)."
  default     = "g5.xlarge"
}

variable "node_count" {
  type        = number
  description = "Number of GPU nodes."
  default     = 1
  validation {
    condition     = var.node_count >= 1 && var.node_count <= 64
    error_message = "node_count must be between 1 and 64."
  }
}

variable "gpus_per_node" {
  type        = number
  description = "GPUs per node (reported to the orchestration for the DeepSpeed hostfile). 0 = look it up from instance_type."
  default     = 0
}

variable "disk_size_gb" {
  type        = number
  description = "Root disk size in GB (models, checkpoints, the Python environment)."
  default     = 200
}

variable "spot" {
  type        = bool
  description = "Use spot instances (cheaper, can be reclaimed; runs resume from checkpoints)."
  default     = false
}

variable "ami_id" {
  type        = string
  description = "Machine image; empty = the newest AWS Deep Learning Base GPU AMI (Ubuntu 22.04)."
  default     = ""
}

variable "vpc_cidr" {
  type        = string
  description = "Address range of the private network between the nodes."
  default     = "10.42.0.0/16"
}

variable "ssh_key_name" {
  type        = string
  description = "Existing EC2 key pair for SSH (empty = no SSH key; use SSM instead)."
  default     = ""
}

variable "ssh_allowed_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach SSH (port 22); empty = SSH closed to the outside."
  default     = []
}

variable "control_plane_cidrs" {
  type        = list(string)
  description = "CIDRs of the control plane (web app, Prefect server): they reach the nodes' server port range, and the nodes reach the Prefect API on them."
  default     = []
}

variable "server_port_range" {
  type        = object({ from = number, to = number })
  description = "Ports the nodes' processes listen on (rollout servers, trainer rendezvous, weight update group), opened to the control plane; the nodes get it as OOLONG_PORT_RANGE."
  default     = { from = 30000, to = 30999 }
  validation {
    condition     = var.server_port_range.from >= 1024 && var.server_port_range.to >= var.server_port_range.from && var.server_port_range.to <= 65535
    error_message = "server_port_range must be 1024 <= from <= to <= 65535."
  }
}

variable "control_plane_vpc_id" {
  type        = string
  description = "The control plane's VPC: when set, the run's VPC is peered with it and the flow reaches the nodes at their private addresses. Empty = no peering (the control plane must then reach the nodes' private addresses some other way)."
  default     = ""
}

variable "control_plane_vpc_cidr" {
  type        = string
  description = "Address range of the control plane's VPC (routed through the peering; must not overlap vpc_cidr)."
  default     = ""
  validation {
    condition     = var.control_plane_vpc_cidr == "" || can(cidrhost(var.control_plane_vpc_cidr, 0))
    error_message = "control_plane_vpc_cidr must be a CIDR such as 10.0.0.0/16."
  }
}

variable "control_plane_route_table_ids" {
  type        = list(string)
  description = "The control plane's route tables that get a route to this run's VPC through the peering."
  default     = []
}

variable "ray_port" {
  type        = number
  description = "Port of the run's Ray cluster on its head (node 0); the other nodes join there."
  default     = 6379
}

variable "ray_client_port" {
  type        = number
  description = "Ray Client port on the head node: the control plane's training-run flow places the run through it (opened to control_plane_cidrs only)."
  default     = 10001
  validation {
    condition     = var.ray_client_port >= 1024 && var.ray_client_port <= 65535 && (var.ray_client_port < 10002 || var.ray_client_port > 19999)
    error_message = "ray_client_port must be 1024..65535 and outside Ray's worker ports (10002-19999)."
  }
}

variable "prefect_api_port" {
  type        = number
  description = "Port of the Prefect API on the control plane (the nodes' workers connect to it)."
  default     = 4200
}

variable "checkpoint_bucket" {
  type        = string
  description = "S3 bucket of the durable checkpoint store (warm-started model, checkpoints); the node role may use only this run's prefix in it. Empty = no store (checkpoints die with the nodes)."
  default     = ""
}

variable "checkpoint_prefix" {
  type        = string
  description = "Key prefix of the store in checkpoint_bucket (no leading or trailing slash)."
  default     = "oolong"
}

variable "checkpoint_run_key" {
  type        = string
  description = "This run's folder under the store (the orchestration's run key, run-<id>)."
}

variable "sglang_version" {
  type        = string
  description = "SGLang release for the rollout servers, installed in an environment of its own (/opt/sglang/venv, Python 3.11, pinned by constraints-sglang.txt): its pins are not the trainer's, but its torch is (one NCCL). Empty = no SGLang (embedded servers)."
  default     = "0.5.23"
}

variable "oolong_build" {
  type = object({
    wheel              = object({ url = string, sha256 = string })
    constraints        = object({ url = string, sha256 = string })
    sglang_constraints = object({ url = string, sha256 = string })
  })
  description = "The exact build the nodes install, each file a URL (s3:// in the run's store, read with the node role; https:// or file://) and its sha256, checked before anything installs it: the control plane's wheel of Oolong, the pins of the trainer's environment (constraints-gpu.txt) and of SGLang's (constraints-sglang.txt). Written by the orchestration (orchestration/builds.py publish_build)."
  validation {
    # Each URL goes into a root shell command: a plain URL, no query, quote, space or expansion.
    condition     = alltrue([for f in values(var.oolong_build) : can(regex("^(s3|https|file)://[A-Za-z0-9._~:/@%+=,-]+$", f.url)) && can(regex("^[0-9a-f]{64}$", f.sha256))])
    error_message = "oolong_build: every file needs an s3://, https:// or file:// URL (letters, digits and ._~:/@%+=,- only) and a sha256 of 64 lowercase hex digits."
  }
  validation {
    condition     = endswith(var.oolong_build.wheel.url, ".whl")
    error_message = "oolong_build.wheel.url must name a wheel file (…/oolong-<version>-py3-none-any.whl): pip installs it by its file name."
  }
}

variable "node_key" {
  type        = string
  sensitive   = true
  description = "The run's node key (OOLONG_NODE_KEY): the flow seals each node process's run credential with it, so only this run's nodes can open what the Prefect API shows every client. One per run, made by the orchestration."
  validation {
    condition     = can(regex("^[A-Za-z0-9_-]{43}=?$", var.node_key))
    error_message = "node_key must be 32 bytes in urlsafe base64 (orchestration/sealing.py new_key)."
  }
}

variable "prefect_api_auth_string" {
  type        = string
  sensitive   = true
  description = "The Prefect API's basic-auth credential (user:password) the node's worker presents (PREFECT_API_AUTH_STRING); the control plane's server requires it (PREFECT_SERVER_API_AUTH_STRING)."
  validation {
    condition     = can(regex("^[A-Za-z0-9._~@+=/-]+:[A-Za-z0-9._~:@+=/-]{16,}$", var.prefect_api_auth_string))
    error_message = "prefect_api_auth_string must be user:password with a password of at least 16 characters (no space, quote or $)."
  }
}

variable "efa" {
  type        = bool
  description = "Give each node its instance type's Elastic Fabric Adapters (p4d: 4, p5: 32, p5en: 16; none elsewhere) and NCCL the libfabric environment for them; false: NCCL over TCP on every type."
  default     = true
}

variable "prefect_api_url" {
  type        = string
  description = "Prefect server API URL the node's worker connects to."
}

variable "work_pool" {
  type        = string
  description = "Prefect work pool the node's worker joins (one per run)."
}

variable "tags" {
  type        = map(string)
  description = "Extra tags for every resource."
  default     = {}
}
