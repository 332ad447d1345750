locals {
  # GPUs per instance type for the DeepSpeed hostfile; override with var.gpus_per_node.
  known_gpus = {
    "g5.xlarge" = 1, "g5.2xlarge" = 1, "g5.12xlarge" = 4, "g5.48xlarge" = 8,
    "g6.xlarge" = 1, "g6.12xlarge" = 4, "p4d.24xlarge" = 8, "p5.48xlarge" = 8
  }
  gpus = var.gpus_per_node > 0 ? var.gpus_per_node : lookup(local.known_gpus, var.instance_type, 1)
  # Elastic Fabric Adapters per instance type, one per network card (docs/clusters.md, "Cloud
  # nodes and interconnect"): NCCL between nodes over EFA instead of TCP. Types not named here
  # have none (g5, g6: NCCL over TCP sockets).
  efa_per_type = {
    "p4d.24xlarge"  = 4, "p4de.24xlarge" = 4, "p5.48xlarge" = 32, "p5e.48xlarge" = 32,
    "p5en.48xlarge" = 16
  }
  efa_count = var.efa ? lookup(local.efa_per_type, var.instance_type, 0) : 0
  efa       = local.efa_count > 0
  tags      = merge({ "oolong:pool" = var.name, "managed-by" = "oolong-terraform" }, var.tags)
  # The store URL the nodes get; the run's folder (checkpoint_run_key) is added by the
  # orchestration's CheckpointStore under it.
  store_root   = trim(var.checkpoint_prefix, "/")
  store_prefix = join("/", compact([local.store_root, var.checkpoint_run_key]))
  store_url    = var.checkpoint_bucket != "" ? "s3://${join("/", compact([var.checkpoint_bucket, local.store_root]))}" : ""
  # Node 0 heads the run's Ray cluster (placement of every process on the GPUs): a fixed private
  # address, so the other nodes' cloud-init can name it before it exists.
  ray_head_ip = cidrhost(aws_subnet.pool.cidr_block, 10)
  # Peered with the control plane's VPC: the flow reaches the nodes at their private addresses
  # (the ones the servers announce, OOLONG_NODE_ADDRESS), and that VPC is one of the CIDRs the
  # security group opens to the control plane.
  peered        = var.control_plane_vpc_id != ""
  control_cidrs = distinct(concat(var.control_plane_cidrs, local.peered ? [var.control_plane_vpc_cidr] : []))
}

data "aws_ami" "deep_learning" {
  count       = var.ami_id == "" ? 1 : 0
  most_recent = true
  owners      = ["amazon"]
  filter {
    name   = "name"
    values = ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)*"]
  }
}

# A private network for the pool: NCCL traffic between nodes stays inside it.
resource "aws_vpc" "pool" {
  cidr_block           = var.vpc_cidr
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = "${var.name}-vpc" })
}

resource "aws_flow_log" "pool" {
  vpc_id               = aws_vpc.pool.id
  traffic_type         = "REJECT"
  log_destination_type = "cloud-watch-logs"
  log_destination      = aws_cloudwatch_log_group.flow.arn
  iam_role_arn         = aws_iam_role.flow_log.arn
}

resource "aws_cloudwatch_log_group" "flow" {
  name              = "/oolong/${var.name}/vpc-flow"
  retention_in_days = 365
  kms_key_id        = aws_kms_key.pool.arn
}

resource "aws_kms_key" "pool" {
  description         = "Encryption for ${var.name} (disks, logs)"
  enable_key_rotation = true
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "Account"
        Effect    = "Allow"
        Principal = { AWS = "arn:aws:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "Logs"
        Effect    = "Allow"
        Principal = { Service = "logs.${var.region}.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
      }
    ]
  })
  tags = local.tags
}

data "aws_caller_identity" "current" {}

resource "aws_iam_role" "flow_log" {
  name = "${var.name}-flow-log"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Principal = { Service = "vpc-flow-logs.amazonaws.com" }, Action = "sts:AssumeRole" }]
  })
  tags = local.tags
}

resource "aws_iam_role_policy" "flow_log" {
  name = "${var.name}-flow-log"
  role = aws_iam_role.flow_log.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect   = "Allow"
      Action   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
      Resource = "${aws_cloudwatch_log_group.flow.arn}:*"
    }]
  })
}

resource "aws_default_security_group" "closed" {
  # The VPC's default group allows nothing: every instance uses the pool's own group.
  vpc_id = aws_vpc.pool.id
  tags   = local.tags
}

resource "aws_subnet" "pool" {
  vpc_id            = aws_vpc.pool.id
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, 1)
  availability_zone = var.availability_zone
  tags              = merge(local.tags, { Name = "${var.name}-subnet" })
}

resource "aws_internet_gateway" "pool" {
  vpc_id = aws_vpc.pool.id
  tags   = local.tags
}

resource "aws_route_table" "pool" {
  vpc_id = aws_vpc.pool.id
  tags   = local.tags
}

# Routes as resources of their own (none inline): the peering's sits beside the internet's.
resource "aws_route" "internet" {
  route_table_id         = aws_route_table.pool.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.pool.id
}

resource "aws_route" "pool_to_control_plane" {
  count                     = local.peered ? 1 : 0
  route_table_id            = aws_route_table.pool.id
  destination_cidr_block    = var.control_plane_vpc_cidr
  vpc_peering_connection_id = aws_vpc_peering_connection.control_plane[0].id
}

# The run's VPC peered with the control plane's (same account and region: accepted here), and
# the way back from the control plane's route tables.
resource "aws_vpc_peering_connection" "control_plane" {
  count       = local.peered ? 1 : 0
  vpc_id      = aws_vpc.pool.id
  peer_vpc_id = var.control_plane_vpc_id
  auto_accept = true
  tags        = merge(local.tags, { Name = "${var.name}-to-control-plane" })
}

resource "aws_route" "control_plane_to_pool" {
  count                     = local.peered ? length(var.control_plane_route_table_ids) : 0
  route_table_id            = var.control_plane_route_table_ids[count.index]
  destination_cidr_block    = aws_vpc.pool.cidr_block
  vpc_peering_connection_id = aws_vpc_peering_connection.control_plane[0].id
}

resource "aws_route_table_association" "pool" {
  subnet_id      = aws_subnet.pool.id
  route_table_id = aws_route_table.pool.id
}

# Only what the fleet needs: all traffic between pool members (NCCL, rollout HTTP, the trainer's
# rendezvous, Ray), the server port range and the head's Ray Client port from the control plane, SSH from the given CIDRs, and egress
# for packages (443, 80) and to the Prefect API on the control plane.
resource "aws_security_group" "pool" {
  name        = "${var.name}-nodes"
  description = "Oolong GPU node pool ${var.name}"
  vpc_id      = aws_vpc.pool.id
  tags        = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "intra_pool" {
  security_group_id            = aws_security_group.pool.id
  description                  = "NCCL, rollout HTTP and launcher traffic between pool nodes"
  referenced_security_group_id = aws_security_group.pool.id
  ip_protocol                  = "-1"
}

resource "aws_vpc_security_group_ingress_rule" "servers_from_control_plane" {
  for_each          = toset(local.control_cidrs)
  security_group_id = aws_security_group.pool.id
  description       = "Rollout servers and the trainer (the server port range) from the control plane"
  cidr_ipv4         = each.value
  from_port         = var.server_port_range.from
  to_port           = var.server_port_range.to
  ip_protocol       = "tcp"
}

resource "aws_vpc_security_group_ingress_rule" "ray_client_from_control_plane" {
  for_each          = toset(local.control_cidrs)
  security_group_id = aws_security_group.pool.id
  description       = "Ray Client on the head node (the training-run flow places the run through it)"
  cidr_ipv4         = each.value
  from_port         = var.ray_client_port
  to_port           = var.ray_client_port
  ip_protocol       = "tcp"
}

resource "aws_vpc_security_group_ingress_rule" "ssh" {
  for_each          = toset(var.ssh_allowed_cidrs)
  security_group_id = aws_security_group.pool.id
  description       = "SSH from operator networks"
  cidr_ipv4         = each.value
  from_port         = 22
  to_port           = 22
  ip_protocol       = "tcp"
}

resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.pool.id
  description       = "Packages, Prefect and tracker APIs over HTTPS"
  cidr_ipv4         = "0.0.0.0/0"
  from_port         = 443
  to_port           = 443
  ip_protocol       = "tcp"
}

resource "aws_vpc_security_group_egress_rule" "http" {
  security_group_id = aws_security_group.pool.id
  description       = "Package mirrors served over plain HTTP (apt)"
  cidr_ipv4         = "0.0.0.0/0"
  from_port         = 80
  to_port           = 80
  ip_protocol       = "tcp"
}

resource "aws_vpc_security_group_egress_rule" "prefect_api" {
  for_each          = toset(local.control_cidrs)
  security_group_id = aws_security_group.pool.id
  description       = "The Prefect API on the control plane (the node's worker)"
  cidr_ipv4         = each.value
  from_port         = var.prefect_api_port
  to_port           = var.prefect_api_port
  ip_protocol       = "tcp"
}

resource "aws_vpc_security_group_egress_rule" "intra_pool" {
  security_group_id            = aws_security_group.pool.id
  description                  = "Traffic between pool nodes"
  referenced_security_group_id = aws_security_group.pool.id
  ip_protocol                  = "-1"
}

resource "aws_placement_group" "pool" {
  name     = "${var.name}-cluster"
  strategy = "cluster"
  tags     = local.tags
}

resource "aws_iam_role" "node" {
  name = "${var.name}-node"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Principal = { Service = "ec2.amazonaws.com" }, Action = "sts:AssumeRole" }]
  })
  tags = local.tags
}

resource "aws_iam_role_policy_attachment" "ssm" {
  role       = aws_iam_role.node.name
  policy_arn = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

# The durable checkpoint store: this run's prefix of the bucket and nothing else (no other
# run's checkpoints, no bucket-wide listing); and, read-only, the builds the control plane
# publishes there by their hash (<prefix>/builds/<sha256>/: Oolong's wheel and its pins, our own
# code, the same for every run of one tree; orchestration/builds.py).
resource "aws_iam_role_policy" "checkpoints" {
  count = var.checkpoint_bucket != "" ? 1 : 0
  name  = "${var.name}-checkpoints"
  role  = aws_iam_role.node.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid      = "RunObjects"
        Effect   = "Allow"
        Action   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
        Resource = "arn:aws:s3:::${var.checkpoint_bucket}/${local.store_prefix}/*"
      },
      {
        Sid      = "ReadBuilds"
        Effect   = "Allow"
        Action   = "s3:GetObject"
        Resource = "arn:aws:s3:::${var.checkpoint_bucket}/${join("/", compact([local.store_root, "builds"]))}/*"
      },
      {
        Sid       = "ListRunPrefix"
        Effect    = "Allow"
        Action    = "s3:ListBucket"
        Resource  = "arn:aws:s3:::${var.checkpoint_bucket}"
        Condition = { StringLike = { "s3:prefix" = [local.store_prefix, "${local.store_prefix}/*"] } }
      }
    ]
  })
}

resource "aws_iam_instance_profile" "node" {
  name = "${var.name}-node"
  role = aws_iam_role.node.name
}

# EFA: one interface per network card of each node (card 0 is the node's primary interface,
# with node 0's fixed address), in the pool's subnet and security group (which lets the pool
# talk to itself on every protocol, as EFA requires).
resource "aws_network_interface" "efa" {
  count           = var.node_count * local.efa_count
  subnet_id       = aws_subnet.pool.id
  security_groups = [aws_security_group.pool.id]
  interface_type  = "efa"
  private_ips     = count.index == 0 ? [local.ray_head_ip] : null
  description     = "${var.name} node ${floor(count.index / max(local.efa_count, 1))} EFA card ${count.index % max(local.efa_count, 1)}"
  tags            = merge(local.tags, { Name = "${var.name}-node-${floor(count.index / max(local.efa_count, 1))}-efa-${count.index % max(local.efa_count, 1)}" })
}

# An instance with several interfaces gets no automatic public address: each EFA node's primary
# interface gets one of its own (package registries, the control plane without peering).
resource "aws_eip" "efa" {
  count             = local.efa ? var.node_count : 0
  domain            = "vpc"
  network_interface = aws_network_interface.efa[count.index * local.efa_count].id
  tags              = merge(local.tags, { Name = "${var.name}-node-${count.index}" })
  depends_on        = [aws_internet_gateway.pool, aws_instance.node] #checkov:skip=CKV2_AWS_19:attached to the node's primary network interface
}

resource "aws_instance" "node" {
  count         = var.node_count
  ami           = var.ami_id != "" ? var.ami_id : data.aws_ami.deep_learning[0].id
  instance_type = var.instance_type
  # Without EFA: one interface, made here. With EFA: the cards' interfaces above, and these
  # three come from them.
  subnet_id                   = local.efa ? null : aws_subnet.pool.id
  private_ip                  = local.efa ? null : (count.index == 0 ? local.ray_head_ip : null)
  vpc_security_group_ids      = local.efa ? null : [aws_security_group.pool.id]
  placement_group             = aws_placement_group.pool.id
  key_name                    = var.ssh_key_name != "" ? var.ssh_key_name : null
  iam_instance_profile        = aws_iam_instance_profile.node.name
  associate_public_ip_address = local.efa ? null : true #checkov:skip=CKV_AWS_88:nodes reach package registries and the control plane; ingress is limited by the security group
  ebs_optimized               = true
  monitoring                  = true

  dynamic "network_interface" {
    for_each = range(local.efa_count)
    content {
      network_interface_id = aws_network_interface.efa[count.index * local.efa_count + network_interface.value].id
      network_card_index   = network_interface.value
      # AWS: the primary interface is device 0 of card 0; every other card's EFA is device 1
      device_index = network_interface.value == 0 ? 0 : 1
    }
  }

  dynamic "instance_market_options" {
    for_each = var.spot ? [1] : []
    content {
      market_type = "spot"
      spot_options {
        instance_interruption_behavior = "terminate"
        spot_instance_type             = "one-time"
      }
    }
  }

  root_block_device {
    volume_size = var.disk_size_gb
    volume_type = "gp3"
    encrypted   = true
    kms_key_id  = aws_kms_key.pool.arn
  }

  metadata_options {
    http_tokens   = "required" # IMDSv2 only
    http_endpoint = "enabled"
  }

  user_data = templatefile("${path.module}/cloud-init.yaml.tftpl", {
    oolong_build            = var.oolong_build
    sglang_version          = var.sglang_version
    prefect_api_url         = var.prefect_api_url
    prefect_api_auth_string = var.prefect_api_auth_string
    node_key                = var.node_key
    efa                     = local.efa
    work_pool               = var.work_pool
    node_index              = count.index
    gpus                    = local.gpus
    ray_head_address        = local.ray_head_ip
    ray_port                = var.ray_port
    ray_client_port         = var.ray_client_port
    port_range              = "${var.server_port_range.from}-${var.server_port_range.to}"
    checkpoint_store        = local.store_url
    runs_dir                = "/opt/oolong/runs"
  })

  tags = merge(local.tags, { Name = "${var.name}-node-${count.index}" })
}
