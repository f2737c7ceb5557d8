{{/*
The image every container runs: repository[:tag][@digest], the tag defaulting to the
chart's appVersion.
*/}}
{{- define "gpuwarden.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- .Values.image.repository -}}
{{- if $tag }}:{{ $tag }}{{ end -}}
{{- if .Values.image.digest }}@{{ .Values.image.digest }}{{ end -}}
{{- end -}}

{{/*
The objects of one file copied from deploy/ (files/...), as a YAML list: every document
parsed, comment-only ones dropped, gpuwarden-system replaced by the namespace value.
Arguments: (list $ "files/<path>").
*/}}
{{- define "gpuwarden.load" -}}
{{- $root := index . 0 -}}
{{- $path := index . 1 -}}
{{- $text := $root.Files.Get $path | replace "gpuwarden-system" $root.Values.namespace.name -}}
{{- $objects := list -}}
{{- range $doc := regexSplit "(?m)^---[ \\t]*$" $text -1 -}}
{{- $object := fromYaml $doc -}}
{{- if hasKey $object "Error" -}}
{{- fail (printf "%s: %s" $path $object.Error) -}}
{{- end -}}
{{- if $object -}}
{{- $objects = append $objects $object -}}
{{- end -}}
{{- end -}}
{{- toYaml $objects -}}
{{- end -}}

{{/*
A pod template's spec with the image values applied to every container.
Arguments: (list $ $podSpec).
*/}}
{{- define "gpuwarden.podImage" -}}
{{- $root := index . 0 -}}
{{- $spec := index . 1 -}}
{{- range $c := $spec.containers -}}
{{- $_ := set $c "image" (include "gpuwarden.image" $root) -}}
{{- with $root.Values.image.pullPolicy }}{{ $_ := set $c "imagePullPolicy" . }}{{ end -}}
{{- end -}}
{{- with $root.Values.imagePullSecrets }}{{ $_ := set $spec "imagePullSecrets" . }}{{ end -}}
{{- end -}}
